#!/usr/bin/env python3
"""Golden reference data for lily's CPU backend, from Hugging Face transformers.

The model directory is in the MLX 4-bit layout (config.json with `text_config` and a
`quantization` block, model.safetensors or sharded model-*.safetensors with
model.safetensors.index.json, tokenizer.json), e.g. the shared lily-tiny-shakespeare model.
The script dequantizes every tensor to float32, maps it onto transformers'
`Qwen3_5MoeForCausalLM` (strict: every model parameter loaded, every checkpoint tensor used),
runs the fixed prompts in float32 on the CPU (batch 1, no padding, no cache) and writes:

  sample_ids       int32   [1024]     sorted, numpy.random.default_rng(1234).choice(vocab, 1024, replace=False)
  p{i}.tokens      int32   [T]        prompt ids (tokenizer.json, no special tokens added)
  p{i}.top_ids     int32   [T, 64]    top-64 token ids per prompt position, by descending logit;
                                      equal logits are ordered by ascending token id
  p{i}.top_logits  float32 [T, 64]    the logits of those ids
  p{i}.sample_logits float32 [T, 1024] logits at sample_ids
  p{i}.greedy      int32   [N]        greedy continuation (argmax, lowest id on ties), every step
                                      re-running the whole sequence with no KV/recurrent cache;
                                      always N tokens, even past an EOS

and string metadata: model, prompts (JSON list), transformers, torch, dtype, greedy, top_k,
sample_seed. Logits are for the prompt positions only.

Regenerate (needs python3 with torch, transformers 5.17, numpy, safetensors, tokenizers):

  python3 scripts/golden.py --model ~/.cache/lily/lily-tiny-shakespeare-*/ \\
      --out crates/lily-model/tests/golden/lily-tiny-shakespeare.safetensors --greedy 64

Options: --prompts FILE.json replaces the built-in prompts with a JSON list of strings;
--threads N sets torch's CPU threads. The run always sanity-checks itself (finite logits,
causal consistency of the no-cache re-runs, special tokens as single ids) and prints every
greedy continuation as text; for lily-tiny-shakespeare it also compares prompt 0's greedy
text with the one its README gives and exits with status 1 (after writing the file) if they
differ.

Dequantization and name mapping use only numpy (torch is imported when the model is built),
so they can be checked on a machine without torch.
"""

import argparse
import contextlib
import importlib
import json
import mmap
import os
import struct
import sys

import numpy as np

TOP_K = 64
SAMPLE_SEED = 1234
N_SAMPLE = 1024

PROMPT_2 = (
    "Good morrow, gentle friends, and lend me now your patient ears, for I have travelled far "
    "across the windy moors to bring you tidings of the king. The night was cold and the road "
    "was long, and more than once I thought my horse would fail beneath me; yet still I pressed "
    "on, for the matter would not wait. In the great hall at Winchester the lords are met in "
    "council, and there is much murmuring among them, for the harvest has been poor and the "
    "treasury is empty. Some say the king will raise new taxes ere the spring; others swear he "
    "means to march against the north. I know not which report is true, but this I know: that "
    "every man who loves his country must be ready, and keep his sword bright and his counsel "
    "close."
)

PROMPT_4 = (
    PROMPT_2
    + "\n\n"
    + "Good even, noble lords, and give me leave to speak, for I have ridden hard across the "
    "frozen fens to bring you news out of the south. The day was bitter and the way was steep, "
    "and more than twice I feared my horse would founder under me; and yet I spurred him on, "
    "because the business would not stay. Within the castle walls at Gloucester the nobles sit "
    "in parliament, and there is muttering among them, for the vintage has been thin and all "
    "the coffers stand bare. Some whisper that the queen will call for loans before the summer; "
    "others vow she means to sail against the French. I cannot tell which rumour holds the "
    "truth, but this I swear: that every soul who loves this land must stand prepared, and keep "
    "his armour oiled and his secrets closer still.\n\n"
    "Thus ended the messenger, and for a while no man in all that company would speak. Then "
    "rose an old knight from the lower end of the table, and leaning on his staff he said: "
    '"Sirs, I have seen three kings and two civil wars, and I tell you plainly that fear is a '
    'worse counsellor than hunger. Let us be patient, and let us be wise."'
)

DEFAULT_PROMPTS = [
    "ROMEO.\n",
    "To be, or not to be, that is the question:\n",
    PROMPT_2,
    "<|im_start|>user\nWhat light through yonder window breaks?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    PROMPT_4,
]
# Minimum token counts of the built-in prompts: prompt 2 must span more than one 64-token
# DeltaNet chunk; prompt 4 gives the full-attention layers a long context.
DEFAULT_MIN_TOKENS = {2: 100, 4: 200}

# Special tokens of the Qwen3.5/3.6 tokenizer (MODEL.md); each must encode as one id.
SPECIAL_TOKENS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<think>": 248068,
    "</think>": 248069,
}
TOKENIZER_PROBE = (
    "The quick brown fox jumps over the lazy dog.",
    [760, 3841, 13477, 37550, 33075, 888, 279, 15217, 5388, 13],
)

# Greedy continuations published with a model (its README), keyed by model directory name.
EXPECTED_GREEDY = {
    "lily-tiny-shakespeare": (
        "ROMEO.\n",
        "And in your city this you ow'd your power,\nAnd there your husband's wrongs at your mind.\n\n",
    ),
}

# Text-config keys that fix the architecture: the built config must hold exactly these values.
ARCH_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "rms_norm_eps", "layer_types",
    "hidden_act", "tie_word_embeddings",
)

# Norm weights that MLX stores as 1 + w and transformers as the offset w.
OFFSET_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


# ----------------------------------------------------------------------------- config


def load_config(model_dir):
    """Returns (text_config dict, quantization dict) from the model directory's config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config")
    assert isinstance(text, dict), "config.json has no text_config"
    assert cfg.get("model_type") == "qwen3_5_moe", f"model_type {cfg.get('model_type')!r}"
    assert text.get("model_type", "qwen3_5_moe_text") == "qwen3_5_moe_text", text.get("model_type")
    assert not text.get("tie_word_embeddings", False), "tied embeddings are not supported"
    assert not cfg.get("tie_word_embeddings", False), "tied embeddings are not supported"
    quant = cfg.get("quantization")
    quant_config = cfg.get("quantization_config")
    if quant is None:
        quant = quant_config
    assert quant is not None, "config.json has no quantization block"
    if quant_config is not None:
        assert quant_config == quant, "quantization and quantization_config differ"
    assert quant.get("mode", "affine") == "affine", f"quantization mode {quant.get('mode')!r}"
    for key in ("bits", "group_size"):
        assert isinstance(quant.get(key), int), f"quantization.{key} missing"
    return text, quant


def module_quant(quant, module):
    """(bits, group_size) for a quantized MLX module path, honouring per-module overrides."""
    override = quant.get(module)
    if override is None:
        return quant["bits"], quant["group_size"]
    assert isinstance(override, dict), f"{module}: quantization override {override!r} but the file has scales"
    return override.get("bits", quant["bits"]), override.get("group_size", quant["group_size"])


def expected_hf_shapes(text):
    """Parameter name -> shape of Qwen3_5MoeForCausalLM, computed from the text config."""
    H = text["hidden_size"]
    V = text["vocab_size"]
    E = text["num_experts"]
    I = text["moe_intermediate_size"]
    Is = text["shared_expert_intermediate_size"]
    nh, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    hd = text.get("head_dim") or H // nh
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    K = text["linear_conv_kernel_dim"]
    conv = 2 * hk * dk + hv * dv
    shapes = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    layer_types = text["layer_types"]
    assert len(layer_types) == text["num_hidden_layers"], "layer_types length"
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if kind == "linear_attention":
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (conv, H)
            shapes[p + "linear_attn.in_proj_z.weight"] = (hv * dv, H)
            shapes[p + "linear_attn.in_proj_b.weight"] = (hv, H)
            shapes[p + "linear_attn.in_proj_a.weight"] = (hv, H)
            shapes[p + "linear_attn.conv1d.weight"] = (conv, 1, K)
            shapes[p + "linear_attn.dt_bias"] = (hv,)
            shapes[p + "linear_attn.A_log"] = (hv,)
            shapes[p + "linear_attn.norm.weight"] = (dv,)
            shapes[p + "linear_attn.out_proj.weight"] = (H, hv * dv)
        elif kind == "full_attention":
            shapes[p + "self_attn.q_proj.weight"] = (2 * nh * hd, H)
            shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, H)
            shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, H)
            shapes[p + "self_attn.o_proj.weight"] = (H, nh * hd)
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        else:
            raise AssertionError(f"layer {i}: unknown layer type {kind!r}")
        shapes[p + "mlp.gate.weight"] = (E, H)
        shapes[p + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
        shapes[p + "mlp.experts.down_proj"] = (E, H, I)
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = (Is, H)
        shapes[p + "mlp.shared_expert.up_proj.weight"] = (Is, H)
        shapes[p + "mlp.shared_expert.down_proj.weight"] = (H, Is)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
    return shapes


# ----------------------------------------------------------------------------- tensors


class RawTensor:
    """A tensor of a safetensors file, read lazily from a memory map."""

    def __init__(self, buf, dtype, shape, begin, end):
        self.buf, self.dtype, self.shape, self.begin, self.end = buf, dtype, tuple(shape), begin, end

    def array(self):
        """The tensor as numpy: U32 -> uint32, F32/F16/BF16 -> float32 (exact)."""
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=self.end - self.begin, offset=self.begin)
        if self.dtype == "U32":
            a = raw.view("<u4")
        elif self.dtype == "F32":
            a = raw.view("<f4")
        elif self.dtype == "F16":
            a = raw.view("<f2").astype(np.float32)
        elif self.dtype == "BF16":
            a = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise AssertionError(f"unsupported safetensors dtype {self.dtype}")
        assert a.size == int(np.prod(self.shape, dtype=np.int64)), "tensor byte size"
        return a.reshape(self.shape)


def read_safetensors_header(path):
    """Maps a safetensors file; returns ({name: RawTensor}, metadata)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8 : 8 + n])
    meta = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        tensors[name] = RawTensor(buf, info["dtype"], info["shape"], 8 + n + begin, 8 + n + end)
    return tensors, meta


def load_tensors(model_dir):
    """All tensors of the directory's model.safetensors, or of the shards its index lists."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        tensors, _ = read_safetensors_header(os.path.join(model_dir, "model.safetensors"))
        return tensors
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        shard_tensors, _ = read_safetensors_header(os.path.join(model_dir, shard))
        for name, t in shard_tensors.items():
            assert weight_map.get(name) == shard, f"{name} is in {shard} but the index says {weight_map.get(name)}"
            assert name not in tensors, f"{name} appears in two shards"
            tensors[name] = t
    missing = set(weight_map) - set(tensors)
    assert not missing, f"tensors in the index but in no shard: {sorted(missing)[:5]}"
    return tensors


def dequantize(packed, scales, biases, bits, group_size):
    """MLX affine dequantization in float32: w = scale[g] * q + bias[g] along the last axis.

    packed: uint32 [..., n_in * bits / 32], element j of each word in bits bits*j.. (low first);
    scales, biases: float32 [..., n_in / group_size]. Returns float32 [..., n_in].
    """
    assert packed.dtype == np.uint32, packed.dtype
    assert bits in (2, 4, 8), f"unsupported bit width {bits}"
    per_word = 32 // bits
    n_in = packed.shape[-1] * per_word
    lead = packed.shape[:-1]
    assert n_in % group_size == 0, (n_in, group_size)
    assert scales.shape == biases.shape == lead + (n_in // group_size,), (packed.shape, scales.shape, biases.shape)
    assert scales.dtype == biases.dtype == np.float32
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    q = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(lead + (n_in // group_size, group_size)).astype(np.float32)
    w = q * scales[..., None] + biases[..., None]
    return w.reshape(lead + (n_in,))


def to_hf_state_dict(tensors, text, quant):
    """Maps the MLX tensors onto Qwen3_5MoeForCausalLM's parameters (numpy float32).

    Asserts that every parameter is produced with the shape the config implies and that every
    language-model tensor of the checkpoint is used (vision tower and MTP tensors are skipped).
    """
    used = set()

    def take(name):
        assert name in tensors, f"checkpoint has no tensor {name}"
        used.add(name)
        return tensors[name].array()

    def weight(module, shape):
        """A Linear/Embedding weight [out, in], dequantized if the module has scales."""
        if module + ".scales" in tensors:
            bits, group_size = module_quant(quant, module)
            packed = take(module + ".weight")
            assert packed.shape == tuple(shape[:-1]) + (shape[-1] * bits // 32,), (
                f"{module}: packed {packed.shape} for {shape} at {bits} bits"
            )
            return dequantize(packed, take(module + ".scales"), take(module + ".biases"), bits, group_size)
        assert module + ".biases" not in tensors, f"{module} has biases but no scales"
        assert tensors[module + ".weight"].dtype != "U32", f"{module} is packed but has no scales"
        return take(module + ".weight")  # an unquantized float weight

    shapes = expected_hf_shapes(text)
    sd = {}
    for name, shape in shapes.items():
        src = "language_model." + name if name.startswith("model.") else "language_model." + name[: -len(".weight")]
        if name == "lm_head.weight":
            w = weight(src, shape)
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = src[: -len("experts.gate_up_proj")] + "switch_mlp."
            I = shape[1] // 2
            gate = weight(base + "gate_proj", (shape[0], I, shape[2]))
            up = weight(base + "up_proj", (shape[0], I, shape[2]))
            w = np.concatenate([gate, up], axis=1)  # gate rows first, then up
        elif name.endswith("mlp.experts.down_proj"):
            w = weight(src[: -len("experts.down_proj")] + "switch_mlp.down_proj", shape)
        elif name.endswith("linear_attn.conv1d.weight"):
            w = take(src)
            assert w.shape == (shape[0], shape[2], 1), f"{src}: {w.shape}"  # MLX [C, K, 1]
            w = w.transpose(0, 2, 1)  # -> [C, 1, K]
        elif name.endswith(("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight")):
            w = take(src)  # used as stored (the gated norm's weight is not an offset)
        elif name == "model.norm.weight" or name.endswith(OFFSET_NORMS):
            w = take(src) - np.float32(1.0)  # MLX stores 1 + w
        else:
            assert name.endswith(".weight"), name
            w = weight(src[: -len(".weight")], shape)
        w = np.array(w, dtype=np.float32, order="C")  # a writable copy, never a view of the file
        assert w.shape == tuple(shape), f"{name}: {w.shape} != {shape}"
        sd[name] = w

    skipped = [n for n in tensors if not n.startswith("language_model.") or n.startswith("language_model.mtp.")]
    for n in skipped:
        assert n.startswith(("vision_tower.", "mtp.", "language_model.mtp.", "model.visual.")), (
            f"unexpected tensor {n}"
        )
    unused = sorted(set(tensors) - used - set(skipped))
    assert not unused, f"checkpoint tensors not used: {unused[:10]} ({len(unused)})"
    return sd, skipped


# ----------------------------------------------------------------------------- model


def build_model(text, state_dict):
    """Qwen3_5MoeForCausalLM in float32 on the CPU, eager attention and experts, weights loaded."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    # The torch reference kernels, not flash-linear-attention / causal-conv1d (GPU kernels).
    for fn_name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(modeling, fn_name)
        origin = getattr(getattr(fn, "__wrapped__", fn), "__module__", "") or ""
        assert origin.startswith("transformers."), f"{fn_name} resolves to {origin}; uninstall fla/causal_conv1d"

    # The text config as from_pretrained would pass it; the dtype is ours (float32).
    kwargs = {k: v for k, v in text.items() if k not in ("model_type", "dtype", "torch_dtype")}
    kwargs["rope_parameters"] = dict(text["rope_parameters"])
    config = Qwen3_5MoeTextConfig(**kwargs)
    for key, value in text.items():
        if key in ("model_type", "dtype", "torch_dtype", "rope_parameters"):
            continue
        if key in ARCH_KEYS or hasattr(config, key):
            assert getattr(config, key) == value, f"config.{key} = {getattr(config, key)!r}, expected {value!r}"
        else:
            print(f"note: text_config.{key} is not a config attribute (consumed by the config)")
    rope = config.rope_parameters
    for key, value in text["rope_parameters"].items():
        assert rope.get(key) == value, f"rope_parameters.{key} = {rope.get(key)!r}, expected {value!r}"
    assert rope.get("rope_type", "default") == "default", rope
    assert config.tie_word_embeddings is False

    # Skip the random initialisation: every parameter is replaced below (strict, assign).
    try:
        no_init = importlib.import_module("transformers.initialization").no_init_weights
    except (ImportError, AttributeError):
        no_init = contextlib.nullcontext
    with no_init():
        model = Qwen3_5MoeForCausalLM._from_config(
            config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    assert getattr(model.config, "_experts_implementation", "eager") == "eager", model.config._experts_implementation

    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in state_dict.items()}
    assert own == ours, (
        f"parameter sets differ: model only {sorted(set(own) - set(ours))[:5]}, "
        f"ours only {sorted(set(ours) - set(own))[:5]}, "
        f"shape mismatches {[k for k in own if k in ours and own[k] != ours[k]][:5]}"
    )
    tensors = {k: torch.from_numpy(v) for k, v in state_dict.items()}
    result = model.load_state_dict(tensors, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, tensors[k]), f"{k} was not loaded as given"
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "lm_head is tied"

    # Partial RoPE on the first head_dim * partial_rotary_factor dims, plain 1-D positions.
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rot = int(head_dim * text["rope_parameters"]["partial_rotary_factor"])
    inv_freq = 1.0 / (text["rope_parameters"]["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    got = model.model.rotary_emb.inv_freq
    assert got.shape == inv_freq.shape and torch.allclose(got, inv_freq, rtol=1e-6, atol=0), "rotary inv_freq"
    assert sum(text["rope_parameters"].get("mrope_section", [rot // 2])) == rot // 2, "mrope_section"

    model.eval()
    return model


def forward_logits(model, ids):
    """float32 logits [T, vocab] for one sequence, no cache."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    logits = out.logits[0]
    assert logits.dtype == torch.float32 and logits.shape[0] == len(ids), (logits.dtype, logits.shape)
    return logits.numpy()


def top_k_desc(logits, k):
    """Top-k ids and logits per row, by descending logit, equal logits by ascending id."""
    ids = np.empty((logits.shape[0], k), dtype=np.int32)
    for t, row in enumerate(logits):
        kth = np.partition(row, row.size - k)[row.size - k]
        cand = np.nonzero(row >= kth)[0]  # ascending ids
        ids[t] = cand[np.argsort(-row[cand], kind="stable")[:k]]
    return ids, np.take_along_axis(logits, ids.astype(np.int64), axis=1).astype(np.float32)


def run_prompt(model, ids, n_greedy, sample_ids):
    """Prompt logits (top-k, sampled) and a cache-free greedy continuation of n_greedy tokens."""
    logits = forward_logits(model, ids)
    assert np.isfinite(logits[0]).all(), "first position's logits are not finite"
    assert np.isfinite(logits).all(), "non-finite logits"
    top_ids, top_logits = top_k_desc(logits, TOP_K)
    sample = np.ascontiguousarray(logits[:, sample_ids], dtype=np.float32)

    seq, greedy, last, drift = list(ids), [], logits[-1], 0.0
    scale = max(1.0, float(np.abs(logits).max()))
    for step in range(n_greedy):
        token = int(np.argmax(last))  # first (lowest) id among equal maxima
        greedy.append(token)
        seq.append(token)
        if step + 1 < n_greedy:
            full = forward_logits(model, seq)
            assert np.isfinite(full).all(), f"non-finite logits at greedy step {step + 1}"
            # Causality: the longer sequence must not change the prompt positions' logits.
            drift = max(drift, float(np.abs(full[: len(ids)] - logits).max()))
            assert drift <= 1e-3 * scale, f"prompt logits moved by {drift} when the sequence grew"
            last = full[-1]
    return {
        "tokens": np.asarray(ids, dtype=np.int32),
        "top_ids": top_ids,
        "top_logits": top_logits,
        "sample_logits": sample,
        "greedy": np.asarray(greedy, dtype=np.int32),
    }, drift


# ----------------------------------------------------------------------------- main


def encode_prompts(tokenizer, prompts, check_lengths):
    probe_text, probe_ids = TOKENIZER_PROBE
    got = tokenizer.encode(probe_text, add_special_tokens=False).ids
    assert got == probe_ids, f"tokenizer probe {probe_text!r}: {got}"
    for token, tid in SPECIAL_TOKENS.items():
        assert tokenizer.token_to_id(token) == tid, f"{token} -> {tokenizer.token_to_id(token)}, expected {tid}"
    encoded = []
    for i, text in enumerate(prompts):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids, f"prompt {i} is empty"
        for token, tid in SPECIAL_TOKENS.items():
            assert ids.count(tid) == text.count(token), f"prompt {i}: {token} is not one id each time"
        if check_lengths and i in DEFAULT_MIN_TOKENS:
            assert len(ids) >= DEFAULT_MIN_TOKENS[i] and len(ids) > 64, f"prompt {i} has only {len(ids)} tokens"
        encoded.append(ids)
    return encoded


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (MLX 4-bit layout)")
    ap.add_argument("--out", required=True, help="output .safetensors file")
    ap.add_argument("--greedy", type=int, default=32, help="greedy continuation length N (default 32)")
    ap.add_argument("--prompts", help="JSON file with a list of prompt strings (replaces the built-in ones)")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    args = ap.parse_args()
    assert args.greedy >= 1, "--greedy must be at least 1"

    import torch
    import transformers
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    assert transformers.__version__.startswith("5."), "transformers 5.x is required"
    if not transformers.__version__.startswith("5.17"):
        print(f"WARNING: the reference is transformers 5.17, this is {transformers.__version__}")

    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
        assert isinstance(prompts, list) and all(isinstance(p, str) for p in prompts), "--prompts: a JSON list of strings"
    else:
        prompts = DEFAULT_PROMPTS

    model_dir = args.model
    model_name = os.path.basename(os.path.normpath(model_dir))
    text, quant = load_config(model_dir)
    tensors = load_tensors(model_dir)
    state_dict, skipped = to_hf_state_dict(tensors, text, quant)
    print(f"{model_name}: {len(tensors)} checkpoint tensors -> {len(state_dict)} parameters "
          f"({sum(v.size for v in state_dict.values()) / 1e6:.1f} M), {len(skipped)} skipped (vision/MTP)")
    model = build_model(text, state_dict)
    del state_dict

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    encoded = encode_prompts(tokenizer, prompts, check_lengths=not args.prompts)

    vocab = text["vocab_size"]
    sample_ids = np.sort(np.random.default_rng(SAMPLE_SEED).choice(vocab, N_SAMPLE, replace=False)).astype(np.int32)
    out = {"sample_ids": sample_ids}
    eos = text.get("eos_token_id") or []
    eos = set(eos if isinstance(eos, list) else [eos])
    decoded = []
    for i, ids in enumerate(encoded):
        result, drift = run_prompt(model, ids, args.greedy, sample_ids)
        for key, value in result.items():
            out[f"p{i}.{key}"] = value
        greedy = result["greedy"].tolist()
        decoded.append(tokenizer.decode(greedy, skip_special_tokens=False))
        eos_at = [j for j, t in enumerate(greedy) if t in eos]
        print(f"\n[p{i}] T={len(ids)} prompt={prompts[i][:60]!r}{'...' if len(prompts[i]) > 60 else ''}")
        print(f"  top-5 at last position: {result['top_ids'][-1, :5].tolist()} "
              f"{np.round(result['top_logits'][-1, :5], 3).tolist()}")
        print(f"  greedy ({len(greedy)} tokens, EOS at {eos_at}, prompt-logit drift {drift:.2e}):")
        print("  " + repr(decoded[-1]))

    metadata = {
        "model": model_name,
        "prompts": json.dumps(prompts),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "greedy": str(args.greedy),
        "top_k": str(TOP_K),
        "sample_seed": str(SAMPLE_SEED),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, args.out, metadata=metadata)
    print(f"\nwrote {args.out}: {len(out)} tensors")

    expected = EXPECTED_GREEDY.get(model_name)
    if expected is not None:
        prompt, text_expected = expected
        if prompt not in prompts:
            print(f"SELF-CHECK skipped: prompt {prompt!r} is not in the prompt list")
            return 0
        got = decoded[prompts.index(prompt)]
        ok = got.startswith(text_expected) if len(got) >= len(text_expected) else text_expected.startswith(got)
        print(f"SELF-CHECK {'PASS' if ok else 'FAIL'}: greedy from {prompt!r} "
              f"{'matches' if ok else 'differs from'} the README's {text_expected!r}")
        if not ok:
            print(f"  got {got!r}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

//! The emulated operand formats of `lily_model::cpu::numerics` reach the prompt path, and leave it bit for bit as
//! it was when switched off. One test in its own binary: the switches are process-wide.

use lily_model::cpu::numerics::{self, AttentionRounding, Operand, Rounding};
use lily_model::cpu::CpuModel;
use lily_model::{default_model, Weights};

fn logits(model: &CpuModel, tokens: &[u32]) -> Vec<f32> {
    model
        .prefill_all_logits(&mut model.new_state(tokens.len()), tokens)
        .unwrap()
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn formats_change_the_prompt_path_by_their_precision() {
    let model = CpuModel::new(Weights::load(&default_model::locate().unwrap()).unwrap());
    let tokens: Vec<u32> = (0..80u32).map(|i| (i * 7919 + 13) % 20000 + 200).collect();
    let exact = logits(&model, &tokens);

    let mut differences = Vec::new();
    let attention = |scores, values, rotated| AttentionRounding::Rounded {
        scores,
        values,
        rotated,
    };
    for (products, attention) in [
        (Rounding::Int8x2 { group: 64 }, AttentionRounding::Exact),
        (Rounding::Bf16, AttentionRounding::Exact),
        (Rounding::E4m3 { group: 128 }, AttentionRounding::Exact),
        (Rounding::Exact, AttentionRounding::BF16),
        (Rounding::Exact, attention(Operand::E4m3, Operand::E4m3, false)),
        (Rounding::Exact, attention(Operand::E4m3, Operand::Bf16, true)),
        (Rounding::Exact, attention(Operand::Bf16, Operand::E4m3, false)),
        (Rounding::Exact, attention(Operand::Int8, Operand::Int8, false)),
        (Rounding::Exact, attention(Operand::Bf16, Operand::E4m3Scaled, false)),
    ] {
        numerics::set_products(products);
        numerics::set_attention(attention);
        let got = logits(&model, &tokens);
        numerics::set_products(Rounding::Exact);
        numerics::set_attention(AttentionRounding::Exact);
        let difference = max_difference(&exact, &got);
        assert!(
            difference > 0.0 && difference < 10.0,
            "{products:?} {attention:?}: {difference}"
        );
        differences.push(difference);
    }
    // Fewer significant bits, larger errors: 14-bit integer codes, bf16's 8 bits, e4m3's 4; the same for the
    // attention's operands.
    assert!(
        differences[0] < differences[1] && differences[1] < differences[2],
        "{differences:?}"
    );
    assert!(differences[4..].iter().all(|&d| d > differences[3]), "{differences:?}");

    // Switched off again, the pass is the exact one.
    assert_eq!(logits(&model, &tokens), exact);
}

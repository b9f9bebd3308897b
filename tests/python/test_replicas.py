"""Two `lily serve` replicas on the CPU behind vllm-router, started by scripts/serve_replicas.sh: every turn of a
conversation (one `X-Session-ID`) reaches the same replica, two conversations are spread over both replicas, the
router answers, streams and passes the API key and errors on like a single server, and stopping the launcher stops
all of them.

Which replica answered is read from each replica's request counters in /metrics, so the requests here run one at a
time. The lily binary comes from LILY_BIN (tests/python/run.sh sets it); vllm-router from the test environment
(scripts/test-requirements.txt). Either missing skips the module with the reason."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "serve_replicas.sh"
MODEL = "lily-tiny-shakespeare"
API_KEY = "lily-replicas-test-key"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CHAT = "/v1/chat/completions"
# The prefix cache's metrics in /metrics have names that start with this; the cache-hit check runs where they are.
PREFIX_CACHE_METRIC = "lily_prefix_cache"


def find_router():
    beside_python = Path(sys.executable).parent / "vllm-router"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("vllm-router")


LILY_BIN = os.environ.get("LILY_BIN")
ROUTER = find_router()
pytestmark = [
    pytest.mark.skipif(not LILY_BIN, reason="LILY_BIN is not set (tests/python/run.sh sets it to the lily under test)"),
    pytest.mark.skipif(
        ROUTER is None,
        reason="vllm-router is not installed (pip install vllm-router==0.1.17; scripts/test-requirements.txt "
        "installs it on x86-64 Linux)",
    ),
]


def port_is_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count, taken=()):
    """`count` consecutive free loopback ports (the launcher gives replica i the port base + i), none of them in
    `taken` (ports already chosen for another part, which nothing holds yet)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        ports = range(base, base + count)
        if base + count < 65536 and all(port_is_free(p) and p not in taken for p in ports):
            return base
    raise RuntimeError("no free loopback ports")


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def chat_counts(replica_urls):
    """Chat requests each replica answered with 200, from its /metrics."""
    counts = []
    for url in replica_urls:
        total = 0
        for line in get(url + "/metrics").splitlines():
            if line.startswith("lily_requests_total{") and f'endpoint="{CHAT}"' in line and 'status="200"' in line:
                total += int(float(line.rsplit(" ", 1)[1]))
        counts.append(total)
    return counts


def answering_replica(replica_urls, request):
    """Runs `request()` and returns its result and the index of the one replica that answered it."""
    before = chat_counts(replica_urls)
    result = request()
    after = chat_counts(replica_urls)
    delta = [a - b for a, b in zip(after, before)]
    assert sorted(delta) == [0] * (len(delta) - 1) + [1], f"chat requests per replica during one request: {delta}"
    return result, delta.index(1)


def accepts_connections(url):
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


class Deployment:
    def __init__(self, tmp_dir):
        self.router_port = free_ports(1)
        self.replica_base = free_ports(2, taken={self.router_port})
        self.metrics_port = free_ports(1, taken={self.router_port, self.replica_base, self.replica_base + 1})
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.replica_urls = [f"http://127.0.0.1:{self.replica_base + i}" for i in range(2)]
        self.log_dir = tmp_dir / "logs"
        command = [
            "bash", str(LAUNCHER), "--replicas", "2", "--port", str(self.router_port),
            "--replica-port", str(self.replica_base), "--metrics-port", str(self.metrics_port),
            "--log-dir", str(self.log_dir), "--lily", LILY_BIN, "--router", ROUTER, "--ready-timeout", "240",
            "--", "--device", "cpu", "--context", "4096", "--max-seqs", "2", "--api-key", API_KEY,
        ]
        # One thread per replica: the three lily servers of a test run share a small machine.
        env = dict(os.environ, RAYON_NUM_THREADS="1", LILY_LOG=os.environ.get("LILY_LOG", "info"))
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.output = []
        self.ready = threading.Event()
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_output(self):
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))
            if line.startswith("ready: "):
                self.ready.set()

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready.wait(0.5):
                return
            if self.process.poll() is not None:
                break
        self.stop()
        pytest.fail("serve_replicas.sh did not become ready:\n" + "\n".join(self.output) + "\n" + self.logs())

    def logs(self):
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            parts.append(f"--- {log.name} (last 20 lines)\n" + "\n".join(lines[-20:]))
        return "\n".join(parts)

    def stop(self):
        """SIGTERM to the launcher, as a user's Ctrl-C or a service manager does; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("replicas"))
    try:
        d.wait_ready(300)
        yield d
    finally:
        if d.process.poll() is None:
            os.killpg(d.process.pid, signal.SIGKILL)
            d.process.wait()


@pytest.fixture(scope="module")
def router_client(deployment):
    return openai.OpenAI(base_url=deployment.router_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def prefix_cache_reported(replica_urls):
    return all(
        any(line.startswith(PREFIX_CACHE_METRIC) for line in get(url + "/metrics").splitlines()) for url in replica_urls
    )


def test_conversations_stay_on_their_replica(deployment, router_client):
    # Runs before any other request names a session: the router's first two conversations go to different
    # replicas (a new conversation goes to the replica holding the fewest).
    sessions = {name: f"conversation-{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b")}
    histories = {
        name: [{"role": "system", "content": f"You are player {name.upper()} in a comedy, and speak in verse."}]
        for name in sessions
    }
    replicas = {name: [] for name in sessions}
    usages = {name: [] for name in sessions}
    questions = ["Who comes here?", "What news from Verona?", "Then speak of the moon."]
    # The conversations take turns in the order a b b a a b, which alternating between replicas (round robin)
    # would split.
    for name in ["a", "b", "b", "a", "a", "b"]:
        session = sessions[name]
        histories[name].append({"role": "user", "content": questions[len(replicas[name])]})
        reply, replica = answering_replica(
            deployment.replica_urls,
            lambda: router_client.chat.completions.create(
                model=MODEL, messages=histories[name], max_tokens=8, temperature=0, extra_body=NO_THINKING,
                extra_headers={"X-Session-ID": session},
            ),
        )
        assert reply.choices[0].message.content
        histories[name].append({"role": "assistant", "content": reply.choices[0].message.content})
        replicas[name].append(replica)
        usages[name].append(reply.usage)

    for name in sessions:
        assert len(set(replicas[name])) == 1, f"conversation {name} went to replicas {replicas[name]}"
    assert replicas["a"][0] != replicas["b"][0], f"both conversations went to replica {replicas['a'][0]}"

    # ---- Prefix cache hits --------------------------------------------------------------------------------------
    # A replica with a prefix cache resumes turns 2 and 3 of a conversation from the state its previous turn left
    # there. Every response carries usage.prompt_tokens_details.cached_tokens already (0 without a cache), so the
    # check runs where the field is present and the replicas' /metrics show a prefix cache.
    if prefix_cache_reported(deployment.replica_urls):
        for name in sessions:
            for turn, usage in enumerate(usages[name][1:], start=2):
                details = usage.prompt_tokens_details
                if details is not None and details.cached_tokens is not None:
                    assert details.cached_tokens > 0, f"conversation {name}, turn {turn}: no cached prompt tokens"


def test_router_answers_streams_and_passes_errors_on(deployment, router_client):
    assert [m.id for m in router_client.models.list().data] == [MODEL]

    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What light through yonder window breaks?"}],
                  max_tokens=10, temperature=0, extra_body=NO_THINKING)
    whole = router_client.chat.completions.create(**kwargs)
    chunks = list(router_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    completion = router_client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=6, temperature=0)
    assert completion.choices[0].text and 1 <= completion.usage.completion_tokens <= 6

    # The replicas check the key the router passes on, and their errors reach the client unchanged.
    wrong_key = openai.OpenAI(base_url=deployment.router_url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(**kwargs)
    with pytest.raises(openai.NotFoundError) as error:
        router_client.chat.completions.create(model="no-such-model", messages=kwargs["messages"], max_tokens=4)
    assert f"this server serves `{MODEL}`" in error.value.message


def test_stopping_the_launcher_stops_everything(deployment):
    urls = [deployment.router_url, *deployment.replica_urls]
    assert all(accepts_connections(url) for url in urls)
    status = deployment.stop()
    assert status == 0, "serve_replicas.sh exited with status %s:\n%s\n%s" % (
        status, "\n".join(deployment.output), deployment.logs())
    still_open = [url for url in urls if accepts_connections(url)]
    assert not still_open, f"still listening after the launcher stopped: {still_open}"
    for i in range(2):
        assert "lily serve: stopped" in (deployment.log_dir / f"replica-{i}.log").read_text(errors="replace")

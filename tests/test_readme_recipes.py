"""The README's vLLM quick start, run as written: its commands come out of README.md's fenced ``bash`` blocks
under "## vLLM quick start" (not retyped here), and they run in one bash session, block after block, as a
newcomer pastes them into one terminal, from a scratch directory where ``configs`` is the checkout's.

What runs and what does not:

- **Skipped**: the install lines (``pip install ...``, the ``torch==2.13.0`` pin file,
  ``kvtier doctor --fix``) and ``kvtier doctor --config ...``.  The test runs inside the environment the
  README's test command installed; pip would reinstall it, and ``kvtier doctor`` judges this machine, not
  the recipe (it has its own tests; on a small disk it warns, exit 1, that the YAML's disk capacity is
  more than is free).  The test checks the skipped lines are exactly those, so a new one fails it.
- **Replaced**: the one ``export MODEL=...`` line, by ``export MODEL=<path>`` of a random-weight Llama
  built here with a byte-level tokenizer saved beside it (nothing downloaded).
- **Run as written**: every other line: the ``export`` lines (``VLLM_CPU_KVCACHE_SPACE``,
  ``PYTHONHASHSEED``), every ``python -m vllm.entrypoints.openai.api_server``
  (the quick start's server, started twice, and the prefill / decode pair), ``redis-server`` and
  ``redis-cli``, the ``curl`` health loops, completions and ``/metrics`` reads, the prompt
  (``P=$(python -c ...)``), ``kill`` / ``wait``.

The recipe's fixed ports (8000-8002, Redis 6379) are free by construction: the session runs in a fresh
network namespace with only loopback up (``unshare --net``), and a PID namespace whose end takes every
process it started with it.  Where namespaces cannot be made (not root), the same commands run in the
machine's own network if those ports are free, else the test fails naming the port.  The session's
environment is the test's own with ``HOME`` a scratch directory (so the recipe's ``~/.cache/kvtier`` is
fresh; only vLLM's model-class facts are copied in, see ``seed_vllm_model_infos``), the running Python's directory first on ``PATH`` (``python`` is this interpreter), no
``KVTIER_*`` / ``PYTHONHASHSEED`` of the caller's, ``HF_HUB_OFFLINE=1`` and ``VLLM_NO_USAGE_STATS=1``.

This supersedes tests/test_vllm.py's OpenAI-server P/D case: both servers' lines from kvtier are in vLLM's
format from the process that wrote them, every block is on disk when the first server has exited (the
restarted server loads them all), vLLM's own external prefix-cache counter counts what kvtier loaded, and
kvtier logs no ERROR line in any server's log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SECTION = "## vLLM quick start"
INSTALL_LINE = re.compile(r"pip install |echo 'torch==2\.13\.0' > \S+$|kvtier doctor( |$)")
PORTS = (8000, 8001, 8002, 6379)
BLOCK_TIMEOUT_S = 900  # a block that starts vLLM servers, on a shared 2-core machine
# The first test pays for the module's fixture: four vLLM server starts, two of them side by side.
pytestmark = pytest.mark.timeout(2400)


def readme_section(text: str, heading: str) -> str:
    """The text under ``heading`` (a ``## `` line) up to the next ``## `` heading."""
    lines = text.splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1:end])


def bash_blocks(markdown: str) -> list[str]:
    """The bodies of the ```` ```bash ```` fenced blocks, in order."""
    return [m.group(1) for m in re.finditer(r"^```bash\n(.*?)^```$", markdown, re.M | re.S)]


def commands(block: str) -> list[str]:
    """A block's commands: continuation lines joined, comment-only and blank lines dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        cur += line
        if line.endswith("\\"):
            cur = cur[:-1]
            continue
        cur = re.sub(r"\s+#[^'\"]*$", "", cur).strip()  # a trailing comment (none holds a quote)
        if cur and not cur.startswith("#"):
            out.append(cur)
        cur = ""
    return out


@dataclass
class Recipe:
    skipped: list[str]          # the install and doctor commands, not run
    blocks: list[str]           # the blocks that run, without those, MODEL replaced
    model_line: str             # the README's export MODEL= line


def vllm_recipe(model: str) -> Recipe:
    blocks = bash_blocks(readme_section(README.read_text(), SECTION))
    skipped = [c for b in blocks for c in commands(b) if INSTALL_LINE.match(c)]
    continued = [ln for b in blocks for ln in b.splitlines() if INSTALL_LINE.match(ln) and ln.endswith("\\")]
    assert not continued, f"install lines continued on the next (this test skips single lines): {continued}"
    run = ["\n".join(ln for ln in b.splitlines() if not INSTALL_LINE.match(ln)) for b in blocks]
    run = [b for b in run if commands(b)]
    model_lines = [ln for b in run for ln in b.splitlines() if ln.startswith("export MODEL=")]
    assert len(model_lines) == 1, model_lines
    run = [re.sub(r"^export MODEL=.*$", f"export MODEL={model}", b, flags=re.M) for b in run]
    return Recipe(skipped, run, model_lines[0])


@dataclass
class Shell:
    """One bash session (in fresh namespaces where it can): blocks go to its stdin, each followed by an
    echo of a marker and the block's status; its output is read until that marker."""

    cwd: Path
    env: dict[str, str]
    proc: subprocess.Popen[str] = field(init=False)
    lines: queue.Queue[str | None] = field(init=False, default_factory=queue.Queue)
    isolated: bool = field(init=False)
    n: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.isolated = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "true"],
                                       capture_output=True).returncode == 0
        if self.isolated:
            cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child",
                   "bash", "--noprofile", "--norc"]
        else:
            for port in PORTS:  # the recipe's ports on this machine's network: they must be free
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        pytest.fail(f"cannot make a network namespace (not root?) and port {port}, which the "
                                    "README's recipe uses, is taken here")
            cmd = ["bash", "--noprofile", "--norc"]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        if self.isolated:
            out, rc = self.run("ip link set lo up", 30)
            assert rc == 0, out

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, block: str, timeout: float = BLOCK_TIMEOUT_S) -> tuple[str, int]:
        """Run ``block``; its output and the status of its last command."""
        self.n += 1
        marker = f"__readme_block_{self.n}_done__"
        assert self.proc.stdin is not None
        logs = {p: p.stat().st_size for p in self.cwd.glob("*.log")}
        self.proc.stdin.write(f"{block}\necho \"{marker} $?\"\n")
        self.proc.stdin.flush()
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=5)
            except queue.Empty:
                died = self._server_died(logs)
                assert not died and time.monotonic() < deadline, (
                    f"block {self.n} {'failed: ' + died if died else f'still running after {timeout} s'}:\n"
                    f"{block}\n--- output so far:\n{''.join(out)}\n{self.log_tails()}")
                continue
            assert line is not None, f"the shell exited in block {self.n}:\n{block}\n{''.join(out)}"
            if line.startswith(marker):
                return "".join(out), int(line.split()[1])
            out.append(line)

    def _server_died(self, before: dict[Path, int]) -> str:
        """A server log's new lines that say its start failed (the README's health loop would wait on)."""
        for p in self.cwd.glob("*.log"):
            with open(p, errors="replace") as f:
                f.seek(before.get(p, 0))
                new = f.read()
            m = re.search(r"^.*(EngineCore failed to start|Engine core initialization failed"
                          r"|Address already in use).*$", new, re.M)
            if m:
                return f"{p.name}: {m.group(0)}"
        return ""

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name} (last 4000 chars):\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.cwd.glob("*.log")))

    def close(self, finished: bool) -> None:
        """End the session: ``exit`` after the last block, else SIGKILL (bash may be in a health loop).
        With namespaces, the end of the session's bash (their PID 1) kills every process left in them."""
        assert self.proc.stdin is not None
        if finished:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("exit\n")
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # unshare and bash: one process group
        self.proc.wait()
        if not self.isolated:  # a daemonized redis-server left the session
            subprocess.run(["redis-cli", "-p", "6379", "shutdown", "nosave"], capture_output=True)


@pytest.fixture(scope="module")
def readme_model(tmp_path_factory) -> str:
    """A random-weight Llama (seeded) whose KV heads / head dim suit vLLM's CPU kernels, with a byte-level
    tokenizer beside it (every byte one token, ids 0-255; ``<|endoftext|>`` 256), so text prompts work."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.fail(f"vLLM is not importable ({e}); run the README's test command (bash tests/run.sh)")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("readme-llama")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
    torch.manual_seed(0)
    eos = vocab["<|endoftext|>"]
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      bos_token_id=eos, eos_token_id=eos)
    llama: Any = LlamaForCausalLM(cfg)
    llama.to(torch.bfloat16).save_pretrained(d)
    return str(d)


def seed_vllm_model_infos(home: Path) -> None:
    """Copy vLLM's model-class facts (``~/.cache/vllm/modelinfos``: one small JSON per architecture, which
    vLLM keys on its model code's hash and rewrites when that differs) into the session's fresh ``HOME``,
    where this machine has them.  Without them the first server inspects the model class in a subprocess
    of its own that imports vLLM again (measured: 26 s of that server's start on this 2-core machine); a
    user's second start never does.  Nothing of kvtier's is copied: ``~/.cache/kvtier`` stays fresh."""
    from vllm import envs

    src = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    if src.is_dir():
        shutil.copytree(src, home / ".cache" / "vllm" / "modelinfos")


@dataclass
class Ran:
    recipe: Recipe
    outputs: list[str]      # each run block's output
    logs: dict[str, str]    # server logs by file name
    home: Path
    isolated: bool


@pytest.fixture(scope="module")
def ran(readme_model, tmp_path_factory) -> Ran:
    """Every block of the recipe but the install one, in order, in one bash session."""
    for tool in ("curl", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed; the README's test command (bash tests/run.sh) installs it")
    recipe = vllm_recipe(readme_model)
    work = tmp_path_factory.mktemp("readme-recipe")
    (work / "configs").symlink_to(ROOT / "configs")
    home = work / "home"
    home.mkdir()
    seed_vllm_model_infos(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "PYTHONHASHSEED"}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    shell = Shell(work, env)
    outputs: list[str] = []
    try:
        for block in recipe.blocks:
            out, rc = shell.run(block)
            outputs.append(out)
            assert rc == 0, (f"a README block ended with status {rc}:\n{block}\n--- output:\n{out}\n"
                             f"{shell.log_tails()}")
    finally:
        shell.close(finished=len(outputs) == len(recipe.blocks))
    logs = {p.name: p.read_text(errors="replace") for p in work.glob("*.log")}
    return Ran(recipe, outputs, logs, home, shell.isolated)


def completions(outputs: list[str]) -> list[dict[str, Any]]:
    """Every /v1/completions response the blocks printed (``python -m json.tool``: one JSON per curl)."""
    dec = json.JSONDecoder()
    found = []
    for text in outputs:
        for m in re.finditer(r"^\{", text, re.M):
            try:
                obj, _ = dec.raw_decode(text, m.start())
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("object") == "text_completion":
                found.append(obj)
    return found


def external_hits(outputs: list[str]) -> list[float]:
    """Every ``vllm:external_prefix_cache_hits_total`` value the blocks printed, in order."""
    return [float(v) for text in outputs
            for v in re.findall(r"^vllm:external_prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M)]


def block_size(recipe: Recipe) -> int:
    sizes = {int(s) for b in recipe.blocks for s in re.findall(r"--block-size (\d+)", b)}
    assert len(sizes) == 1, sizes
    return sizes.pop()


def loadable(prompt_tokens: int, bs: int) -> int:
    """Prompt tokens a connector can supply: whole blocks, leaving vLLM at least the last token to compute."""
    return (prompt_tokens - 1) // bs * bs


def test_recipe_skips_only_the_install(ran):
    assert ran.recipe.skipped == [
        "pip install torch==2.13.0", "echo 'torch==2.13.0' > /tmp/torch-pin.txt",
        "pip install -c /tmp/torch-pin.txt -e '.[vllm,prometheus]'", "kvtier doctor --fix",
        "kvtier doctor --config configs/vllm-local.yaml --engine vllm"], ran.recipe.skipped
    assert ran.recipe.model_line.startswith("export MODEL=")
    assert set(ran.logs) == {"vllm.log", "prefill.log", "decode.log"}, sorted(ran.logs)


def test_restarted_server_loads_the_prompt_from_kvtiers_disk(ran):
    """The quick start: the first request computes everything; after the restart (vLLM's own prefix cache
    is gone) every whole block of the prompt comes from kvtier's disk: all of them reached it before the
    first server exited, and vLLM's own counter says the connector supplied them."""
    bs = block_size(ran.recipe)
    first, second = completions(ran.outputs)[:2]
    n = first["usage"]["prompt_tokens"]
    assert n >= 8 * bs, f"the README's prompt fills only {n} tokens: fewer than 8 blocks of {bs}"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens"] == n
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable(n, bs)
    assert external_hits(ran.outputs)[0] == loadable(n, bs)
    files = [p for p in (ran.home / ".cache" / "kvtier" / "vllm").rglob("*")
             if p.is_file() and re.fullmatch(r"[0-9a-f]{64}", p.name)]
    assert len(files) >= n // bs, f"{len(files)} block files for a prompt of {n // bs} whole blocks"


def test_decode_server_loads_what_the_prefill_server_stored(ran):
    """P/D over Redis: the prefill server computes the prompt; the decode server loads every whole block
    of it from Redis (usage and vLLM's external prefix-cache counter, over HTTP)."""
    bs = block_size(ran.recipe)
    got = completions(ran.outputs)
    assert len(got) == 4, f"expected 4 completions (2 quick start, prefill, decode), got {len(got)}"
    prefill, decode = got[2:]
    n = prefill["usage"]["prompt_tokens"]
    assert prefill["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert decode["usage"]["prompt_tokens"] == n
    assert decode["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable(n, bs)
    hits = external_hits(ran.outputs)
    assert len(hits) == 2, hits
    assert hits[1] == loadable(n, bs)


def kvtier_sources() -> set[str]:
    """File names only kvtier's modules have (vLLM's log format names the file, not the logger): a line
    logged from one of them is kvtier's even where its message does not say "kvtier" (``local_disk: ...``)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    ours = {p.name for d in ("kvtier", "backends", "policies") for p in (ROOT / d).rglob("*.py")}
    return ours - {f for _, _, files in os.walk(Path(spec.origin).parent) for f in files}


def test_kvtier_logs_in_vllms_format_and_no_error(ran):
    """kvtier's lines are in every server's log, in vLLM's format, from the process that wrote them; none
    of them is an ERROR (a line logged from a kvtier module, or naming kvtier, as a traceback through
    kvtier's code does).  Other ERROR lines (vLLM's own) are printed, not judged."""
    for name, log in ran.logs.items():
        for proc, line in (("EngineCore", "scheduler side up"), ("Worker", "worker side up")):
            assert re.search(rf"\({proc}\S* pid=\d+\) INFO .*kvtier: {line}", log), (name, log[-3000:])
    ours = kvtier_sources()

    def kvtiers(line: str) -> bool:
        m = re.search(r"\bERROR\b.*?\[([\w.]+):\d+\]", line)
        return "kvtier" in line or (m is not None and m.group(1) in ours)

    errors = {name: [ln for ln in log.splitlines() if re.search(r"\bERROR\b", ln)]
              for name, log in ran.logs.items()}
    others = {name: [ln for ln in lines if not kvtiers(ln)] for name, lines in errors.items()}
    print("ERROR lines not from kvtier:", json.dumps({k: v for k, v in others.items() if v}, indent=1))
    kvtier_errors = {name: [ln for ln in lines if kvtiers(ln)] for name, lines in errors.items()}
    assert not any(kvtier_errors.values()), json.dumps(kvtier_errors, indent=1)


def test_readme_links_resolve():
    """Every relative link in the README names a file or folder of the checkout."""
    text = README.read_text()
    targets = {m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text)
               if not re.match(r"[a-z]+://|#|mailto:", m)}
    missing = sorted(t for t in targets if not (ROOT / t).exists())
    assert not missing, f"README links to files that do not exist: {missing}"

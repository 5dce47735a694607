"""One real vLLM process (CPU build) for the connector tests: serve a local random-weight Llama, run the
prompts one at a time (so which blocks vLLM's own prefix cache holds is deterministic), write greedy
tokens, top logprobs and cached-token counts as JSON.

    python tests/vllm/driver.py --model DIR --role kv_producer|kv_consumer|kv_both|none --config YAML
        --prompts FILE --out FILE [--pause-after K --ready FILE --go FILE] [--load-mode M]
        [--while-decoding] [--abort-first] [--together --num-blocks N] [--salts S1,S2,...]

``--pause-after K``: after K prompts, create ``--ready`` and wait for ``--go`` (a test kills a server
in between).  ``--load-mode`` / ``--idle-wait-ms``: the connector's ``kv_connector_extra_config.load_mode`` /
``idle_wait_ms``.
``--while-decoding``: another request decodes the whole time each prompt is served (admitted after it
has run a few steps), so the prompt's load meets a running request.  ``--abort-first``: before the
prompts, the first one is sent and aborted as soon as its load has started, and the driver steps the engine until
vLLM has every KV block free again (the engine runs in this process for this) (``abort`` in the JSON).  ``KVTIER_LOG_LEVEL`` sets kvtier's log
level (INFO).  ``--together``: all prompts in one ``generate`` call (vLLM batches them); with
``--num-blocks`` (vLLM's KV cache size in blocks) small enough, it preempts some and resumes them later.
``--max-batched-tokens``: vLLM's token budget per step (a longer prompt is prefilled in chunks).
``--salts``: each prompt's ``cache_salt`` (a tenant's), in order; ``-`` for none.  ``--reset-between``:
vLLM's own prefix cache is emptied before each prompt, so every hit is kvtier's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, cast

from kvtier.testing.hybrid_models import GDN_STATE_DTYPE

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.connector import KvtierConnector

# At import, not in main(): vLLM's worker processes are spawned and import this module without running
# main(), and the tests read what kvtier logs there.
logging.basicConfig(level=logging.INFO, format="%(processName)s %(name)s %(levelname)s %(message)s")
logging.getLogger("kvtier").setLevel(os.environ.get("KVTIER_LOG_LEVEL", "INFO"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", default="none")
    ap.add_argument("--config")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--hash-algo", default="sha256_cbor")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pause-after", type=int, default=-1)
    ap.add_argument("--ready")
    ap.add_argument("--go")
    ap.add_argument("--load-mode")
    ap.add_argument("--idle-wait-ms", type=float)
    ap.add_argument("--while-decoding", action="store_true")
    ap.add_argument("--abort-first", action="store_true")
    ap.add_argument("--together", action="store_true")
    ap.add_argument("--num-blocks", type=int)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batched-tokens", type=int)
    ap.add_argument("--salts")
    ap.add_argument("--reset-between", action="store_true")
    ap.add_argument("--attention-backend", help="vLLM's attention backend by name (default: vLLM picks)")
    ap.add_argument("--kv-events-out", help="publish vLLM's KV events (ZMQ, loopback) and write the batches a "
                                            "subscriber in this process decoded with vLLM's classes to this JSON file")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.abort_first or (a.tp == 1 and not a.while_decoding):
        # The engine core and its one worker in this process, as vLLM runs them without multiprocessing:
        # the same scheduler and worker connector calls, with one vLLM import instead of three (its CPU
        # build spawns the engine core and then the worker, each importing vLLM again: about 35 s of every
        # run on this 2-core machine).  With abort_first one LLMEngine.step() is exactly one engine step.
        # TP > 1 keeps vLLM's worker processes (the ranks' reports cross processes there), and so does
        # --while-decoding (a free-running engine core decides a load's mode from the steps it really ran
        # beside it); the README's recipe test runs real multi-process OpenAI servers.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.tp > 1:  # one NUMA node here: vLLM CPU cannot auto-bind several ranks, so one core per rank
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                     for i in range(a.tp)))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        _fork_vllms_processes()

    kw: dict[str, Any] = {}
    if a.role != "none":
        extra = {"kvtier_config": a.config} if a.config else {}
        if a.load_mode:
            extra["load_mode"] = a.load_mode
        if a.idle_wait_ms is not None:
            extra["idle_wait_ms"] = a.idle_wait_ms
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role=a.role, kv_connector_extra_config=extra)
    t0 = time.perf_counter()
    if a.num_blocks:
        kw["num_gpu_blocks_override"] = a.num_blocks
    if a.attention_backend:
        kw["attention_config"] = {"backend": a.attention_backend}
    if a.max_batched_tokens:  # a prompt longer than this is prefilled in chunks, one per step
        kw["max_num_batched_tokens"] = a.max_batched_tokens
    events = None
    if a.kv_events_out:
        events = _EventSubscriber()
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://127.0.0.1:{events.port}"}
    llm = LLM(model=a.model, skip_tokenizer_init=True, enforce_eager=True, block_size=a.block_size,
              dtype="bfloat16", max_model_len=a.max_model_len, enable_prefix_caching=True,
              prefix_caching_hash_algo=a.hash_algo, seed=0, tensor_parallel_size=a.tp,
              mamba_ssm_cache_dtype=GDN_STATE_DTYPE, **kw)
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, logprobs=2, detokenize=False)
    with open(a.prompts) as f:
        prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in json.load(f)]
    for p, salt in zip(prompts, a.salts.split(",") if a.salts else []):
        if salt != "-":
            p["cache_salt"] = salt
    results = []
    aborted = _abort_while_loading(llm, prompts[0]["prompt_token_ids"], params) if a.abort_first else None
    if a.together:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        results = [_result(o, time.perf_counter() - t) for o in outs]
        prompts = []
    for i, p in enumerate(prompts):
        if i == a.pause_after:
            open(a.ready, "w").close()
            while not os.path.exists(a.go):
                time.sleep(0.05)
        if a.reset_between and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache between prompts (blocks still in use)")
        t = time.perf_counter()
        if a.while_decoding:
            out = _while_decoding(llm, p, params, f"p{i}")
        else:
            out = llm.generate([p], params, use_tqdm=False)[0]
        results.append(_result(out, time.perf_counter() - t))
    with open(a.out, "w") as f:
        json.dump({"startup_s": startup, "results": results, "abort": aborted}, f)
    if events is not None:
        # Writes and evictions that end after the last prompt reach the scheduler with a later step's worker
        # reports: step the idle engine a while (a served instance steps on as requests come).
        for _ in range(40):
            llm.llm_engine.step()
            time.sleep(0.05)
        time.sleep(0.5)  # the last batches are published from vLLM's publisher thread
        rows = events.stop()
        with open(a.kv_events_out, "w") as f:
            json.dump(rows, f)
        with open(a.kv_events_out + ".raw", "w") as f:  # the payloads as published, for a router's own decoder
            json.dump([payload.hex() for _, _, payload in events.frames], f)


class _EventSubscriber:
    """A ZMQ SUB socket bound on a free loopback port (vLLM's publisher connects to it), receiving on a
    thread of its own; ``stop`` decodes the batches with vLLM's own ``KVEventBatch``."""

    def __init__(self) -> None:
        import threading

        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.frames: list[list[bytes]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._done.is_set():
            if poller.poll(100):
                self.frames.append(self._sock.recv_multipart())

    def stop(self) -> list[dict[str, Any]]:
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        self._done.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        out = []
        for _topic, seq, payload in self.frames:
            batch = dec.decode(payload)
            for ev in batch.events:
                row = {"seq": int.from_bytes(seq, "big"), "type": type(ev).__name__}
                for f in ("medium", "locality", "ownership", "group_idx"):
                    row[f] = getattr(ev, f, None)
                if hasattr(ev, "block_hashes"):
                    row["hashes"] = [h.hex() if isinstance(h, bytes) else str(h) for h in ev.block_hashes]
                if isinstance(ev, BlockStored):
                    row["tokens"] = len(ev.token_ids)
                    p = ev.parent_block_hash
                    row["parent"] = p.hex() if isinstance(p, bytes) else None if p is None else str(p)
                out.append(row)
        return out


def _fork_vllms_processes() -> None:
    """vLLM's engine core and worker processes forked from this one, as vLLM starts them on Linux GPUs,
    rather than spawned, as its CPU build insists (its platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
    whenever a config is made): a spawned process imports vLLM again, about 25 CPU-seconds each on this
    2-core machine, three of them in a TP=2 run.  Each is still a process of its own, with its own engine
    core or rank, connector side and host memory; nothing in this one has run a model or started a
    connector when they fork (kvtier's scheduler side starts in the engine core, its worker side in each
    rank).  The README's recipe test runs vLLM's OpenAI servers as they are (spawned).

    What spawning gave a rank and a fork does not: vLLM binds each rank's OpenMP threads through variables
    it sets around the child's start (``GOMP_CPU_AFFINITY`` or ``OMP_PLACES``, ``OMP_NUM_THREADS``), which
    the OpenMP runtime reads only when it loads.  A forked rank applies them itself, first thing, before it
    runs anything: its thread count and its thread bound to those CPUs, as a spawned rank's runtime does."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]

    def bind_as_spawned() -> None:
        cpus = os.environ.get("GOMP_CPU_AFFINITY", "").split() or \
            os.environ.get("OMP_PLACES", "").strip("{}").split(",")
        if cpus and cpus != [""] and os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            os.sched_setaffinity(0, {int(c) for c in cpus})

    os.register_at_fork(after_in_child=bind_as_spawned)


def _result(out, seconds: float) -> dict[str, Any]:
    o = out.outputs[0]
    return {"tokens": list(o.token_ids), "logprobs": [{str(k): v.logprob for k, v in lp.items()} for lp in o.logprobs],
            "cached": out.num_cached_tokens, "seconds": seconds}


def _abort_while_loading(llm, prompt: list[int], params) -> dict[str, Any]:
    """Send ``prompt``, run the one engine step that schedules it (the connector offers its stored prefix
    and the load starts in the background), abort it, then wait until every KV block is free again.
    vLLM keeps an aborted request's blocks until the connector reports its load ended, so a prefix-cache
    reset (refused while any block is in use) right after the abort says whether the load was still
    running then; one that never succeeds means the blocks leaked.

    The worker's storage reads wait behind a gate (the same backend, held) until the abort has been
    checked: without it a fast CPU read B's few small blocks within the step that started the load, the
    scheduler heard of its end before the abort, and the test raced the machine."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    from kvtier.integrations.vllm.worker import WorkerSide
    from kvtier.testing.faults import FaultyBackend

    eng = llm.llm_engine
    scheduler = eng.engine_core.engine_core.scheduler
    worker = cast("KvtierConnector", get_kv_transfer_group())._worker  # in process (no multiprocessing)
    assert isinstance(worker, WorkerSide)  # the test model has one KV cache group
    backends = worker.stack.planner.backends.backends
    held = FaultyBackend(backends[0])
    backends[0] = held
    gate = held.gate("get", max_wait=120)
    eng.add_request("aborted", {"prompt_token_ids": prompt}, params)
    # The connector answers "ask again" while its backend probe is in flight: step until the load starts,
    # bounded by time, not by a count of steps (an idle step takes microseconds, a probe on a busy machine
    # took longer than 1,000 of them).
    deadline = time.perf_counter() + 60
    while True:
        eng.step()
        req = next((r for i, r in scheduler.requests.items() if i.startswith("aborted")), None)
        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        if time.perf_counter() > deadline:
            raise RuntimeError("the connector never started a load for the prompt (60 s)")
    if not gate.entered.wait(60):
        raise RuntimeError("the load never read its storage (60 s)")
    eng.abort_request(["aborted"])
    in_use_after_abort = not llm.reset_prefix_cache()
    gate.release()
    t0, steps = time.perf_counter(), 0
    while not llm.reset_prefix_cache():
        if time.perf_counter() - t0 > 60:
            return {"in_use_after_abort": in_use_after_abort, "freed_after_steps": None}
        eng.step()  # the engine keeps stepping while a finished request's blocks wait on the connector
        steps += 1
        time.sleep(0.01)
    return {"in_use_after_abort": in_use_after_abort, "freed_after_steps": steps}


def _while_decoding(llm, prompt: TokensPrompt, params, req_id: str):
    """Serve ``prompt`` while another request (unrelated tokens) decodes: it runs 4 steps first and is
    aborted once the prompt has finished."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    dec = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True, detokenize=False)
    eng.add_request(f"{req_id}-decoder", {"prompt_token_ids": list(range(400, 440))}, dec)
    for _ in range(4):
        eng.step()
    eng.add_request(req_id, prompt, params)
    while True:
        for o in eng.step():
            if o.request_id == req_id and o.finished:
                eng.abort_request([f"{req_id}-decoder"])
                while eng.has_unfinished_requests():
                    eng.step()
                return o


if __name__ == "__main__":
    main()

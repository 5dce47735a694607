"""Asynchronous, batched copies between the device tier and the host tier ("moving bytes").

``TransferEngine.store(block_ids, slots)`` copies device blocks into host slots; ``load(slots, block_ids)``
copies host slots into device blocks, layer by layer.  Both return a :class:`TransferHandle` at once.
On CUDA the copies run on the engine's own streams (one per direction), ordered after the work already
queued on the caller's current stream, and each layer of a load records an event; on CPU a worker thread
pool does the copies and signals each layer as it lands (FastDeploy's LayerDoneCounter).

Invariants:
* every block of a batch ends up in exactly one of ``result.ok_*`` / ``result.failed_*``; a block is ok
  only if all of its bytes were copied.  A failed load's ``failed_block_ids`` are the device blocks the
  engine must recompute; they are never reported as loaded;
* a fault inside a worker (bad block id, slot in the wrong state, a CUDA error, an exception from a hook)
  fails the affected blocks; it never raises in the caller's thread and never leaves a waiter hanging;
* every wait takes a timeout and raises ``TimeoutError`` when it expires (the transfer keeps going: do not
  reuse its destination blocks or slots until ``done()``);
* a slot that is not READY at submission (or, with keys, no longer holds its key) fails that block of a
  load; keeping a load's slots from being freed until it is done is the caller's part (the stack holds
  an index reference on every block it loads: the host tier keeps no pin count of its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import threads as kvthreads
from .blockids import BlockIds, int_array
from .device import DeviceTier, Direction
from .host import READY, WRITING, HostTier

log = logging.getLogger("kvtier.transfer")
_POLL_S = 0.0001  # CUDA event polling step of a host wait with a timeout


class LayerDoneCounter:
    """How many leading layers of one transfer have landed; waits with timeouts.  Layers are marked in
    order; ``finish()`` releases every waiter (the transfer is over, whatever its outcome)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._done = 0
        self._ok_upto = 0  # layers that landed successfully (the rest were given up)
        self._events: list[Any] = [None] * num_layers
        self._cond = threading.Condition()

    @property
    def layers_done(self) -> int:
        return self._done

    def mark_layer_done(self, layer: int, event: Any = None) -> None:
        with self._cond:
            if layer != self._done:
                raise RuntimeError(f"layer {layer} marked done after {self._done} layers: must be in order")
            self._events[layer] = event
            self._done = self._ok_upto = layer + 1
            self._cond.notify_all()

    def mark_all_done(self, event: Any = None) -> None:
        """Every layer landed at once (a whole-block copy); ``event`` covers them all."""
        with self._cond:
            self._events = [event] * self.num_layers
            self._done = self._ok_upto = self.num_layers
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._done = self.num_layers
            self._cond.notify_all()

    def wait_layer(self, layer: int, timeout: float | None = None) -> tuple[bool, Any]:
        """Block until layer ``layer`` is accounted for; returns (landed, its CUDA event or None)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        with self._cond:
            if not self._cond.wait_for(lambda: self._done > layer, timeout):
                raise TimeoutError(f"layer {layer} not done after {timeout} s ({self._done} layers done)")
            return layer < self._ok_upto, self._events[layer]


@dataclass(frozen=True)
class TransferResult:
    """Per-block outcome of one batch.  ``ok[i]`` is for ``block_ids[i]`` / ``slots[i]``."""

    direction: Direction
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    ok: tuple[bool, ...]
    errors: tuple[str, ...] = ()
    seconds: float = 0.0
    nbytes: int = 0  # bytes of the blocks that succeeded

    @property
    def all_ok(self) -> bool:
        return all(self.ok)

    @property
    def ok_block_ids(self) -> list[int]:
        return [b for b, k in zip(self.block_ids, self.ok) if k]

    @property
    def failed_block_ids(self) -> list[int]:
        """For a load: the device blocks the engine must recompute."""
        return [b for b, k in zip(self.block_ids, self.ok) if not k]

    @property
    def ok_slots(self) -> list[int]:
        return [s for s, k in zip(self.slots, self.ok) if k]

    @property
    def failed_slots(self) -> list[int]:
        return [s for s, k in zip(self.slots, self.ok) if not k]


class TransferHandle:
    """A batch in flight: poll ``done()``, ``wait()`` for the :class:`TransferResult`, or
    ``wait_layer(i)`` to use layer ``i`` of a load while later layers are still copying."""

    def __init__(self, direction: Direction, block_ids: Sequence[int], slots: Sequence[int], num_layers: int,
                 device: torch.device):
        self.direction = direction
        # Callers pass Python ints (``ndarray.tolist()``): a tuple of them, not an int() per element.
        self.block_ids = tuple(block_ids)
        self.slots = tuple(slots)
        self.counter = LayerDoneCounter(num_layers)
        self._device = device
        self._done = threading.Event()
        self._result: TransferResult | None = None
        self._cancel = threading.Event()
        self._callbacks: list[Callable[[TransferResult], None]] = []
        self._cb_lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def layers_done(self) -> int:
        return self.counter.layers_done

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The result, once every byte has landed or failed; ``TimeoutError`` after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.direction} of {len(self.block_ids)} blocks not done after {timeout} s "
                               f"({self.counter.layers_done}/{self.counter.num_layers} layers)")
        assert self._result is not None
        return self._result

    def result(self) -> TransferResult | None:
        """The result if done, else None (never waits)."""
        return self._result

    def wait_layer(self, layer: int, timeout: float | None = None, *, sync: bool = False) -> bool:
        """Return once layer ``layer`` of this load is in device memory: True, or False when the transfer
        failed or was cancelled before it (its blocks are then in ``failed_block_ids``).

        On CUDA the host only waits for the layer's copies to be *issued*, then the caller's current
        stream is made to wait for them on the GPU (no host stall); ``sync=True`` waits on the host
        until they have completed.  ``TimeoutError`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        landed, event = self.counter.wait_layer(layer, timeout)
        if landed and event is not None:
            if sync:
                _wait_event(event, deadline, f"layer {layer}")
            else:
                torch.cuda.current_stream(self._device).wait_event(event)
        return landed

    def cancel(self) -> None:
        """Stop before the next layer that has not started; its blocks fail.  Layers already issued
        complete: wait for ``done()`` before reusing the destination."""
        self._cancel.set()

    def add_done_callback(self, fn: Callable[[TransferResult], None]) -> None:
        """``fn(result)`` once done (at once if already done), in a worker thread; exceptions are logged."""
        with self._cb_lock:
            if self._result is None:
                self._callbacks.append(fn)
                return
        _call(fn, self._result)

    def _finish(self, result: TransferResult) -> None:
        with self._cb_lock:
            self._result = result
            callbacks, self._callbacks = self._callbacks, []
        self.counter.finish()
        self._done.set()
        for fn in callbacks:
            _call(fn, result)


class TransferGroup:
    """Several transfer handles of one direction seen as one (a pipelined load submits a copy per chunk
    it has read).  The merged result lists the handles' blocks in submission order; a layer has landed
    when it has in every handle."""

    def __init__(self, handles: Sequence[TransferHandle]):
        if not handles:
            raise ValueError("TransferGroup: no handles")
        self.handles = list(handles)
        self._lock = threading.Lock()
        self._left = len(self.handles)
        self._result: TransferResult | None = None
        self._callbacks: list[Callable[[TransferResult], None]] = []
        self._done = threading.Event()
        for h in self.handles:
            h.add_done_callback(self._one_done)

    def _one_done(self, _: TransferResult) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
            rs = [h.result() for h in self.handles]
            self._result = TransferResult(
                rs[0].direction if rs[0] else Direction.LOAD,
                tuple(b for r in rs if r for b in r.block_ids), tuple(x for r in rs if r for x in r.slots),
                tuple(k for r in rs if r for k in r.ok), tuple(e for r in rs if r for e in r.errors),
                max((r.seconds for r in rs if r), default=0.0), sum(r.nbytes for r in rs if r))
            callbacks, self._callbacks = self._callbacks, []
        self._done.set()
        for fn in callbacks:
            _call(fn, self._result)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> TransferResult | None:
        return self._result

    def wait(self, timeout: float | None = None) -> TransferResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{len(self.handles)} transfers not done after {timeout} s")
        assert self._result is not None
        return self._result

    def wait_layer(self, layer: int, timeout: float | None = None, *, sync: bool = False) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        landed = True
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            landed = h.wait_layer(layer, left, sync=sync) and landed
        return landed

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def add_done_callback(self, fn: Callable[[TransferResult], None]) -> None:
        with self._lock:
            if self._result is None:
                self._callbacks.append(fn)
                return
        _call(fn, self._result)


@dataclass
class _Batch:
    """One submitted batch, as the issuing and completion threads pass it on."""

    handle: TransferHandle
    ids: np.ndarray         # device block ids (int64)
    slots: np.ndarray       # host slots, same length
    ok: np.ndarray          # bool, per block: passed the submission checks
    errors: list[str]       # what failed, appended to as the batch goes
    layerwise: bool
    keys: Sequence[Hashable] | None  # with a store: commit the ok slots with these; with a load: checked
    ready: Any              # CUDA: the event after the caller's queued compute; None on CPU
    t0: float               # perf_counter at submission


class TransferEngine:
    """Moves blocks between a :class:`DeviceTier` and a :class:`HostTier`.

    ``layer_hook(direction, layer)``, when given, runs in the worker after each layer is issued (tests
    use it to slow or block a transfer; an exception from it fails the blocks not yet complete).
    ``max_staging_bytes`` bounds the CUDA staging buffer a batch uses at once (batches are chunked).
    """

    def __init__(self, device: DeviceTier, host: HostTier, *, num_workers: int = 2,
                 layer_hook: Callable[[Direction, int], object] | None = None, max_staging_bytes: int = 256 << 20):
        if device.block_nbytes != host.block_nbytes:
            raise ValueError(f"device blocks are {device.block_nbytes} B but host slots are "
                             f"{host.block_nbytes} B: build the host tier from the same layout")
        self.device, self.host = device, host
        self.layer_hook = layer_hook
        self._chunk = max(1, max_staging_bytes // device.block_nbytes)
        self._cuda = device.is_cuda
        if self._cuda:
            # One issuing thread and one stream per direction keeps each direction's batches in order;
            # a completion thread per direction waits on the events so issuing never stalls.
            self._streams = {d: torch.cuda.Stream(device.device) for d in Direction}
            self._issue = {d: kvthreads.pool(1, f"kvtier-{d.value}") for d in Direction}
            self._complete = {d: kvthreads.pool(1, f"kvtier-{d.value}-done") for d in Direction}
        else:
            pool = kvthreads.pool(num_workers, "kvtier-xfer")
            self._issue = dict.fromkeys(Direction, pool)
        self._lock = threading.Lock()
        self._stats = {"loads": 0, "stores": 0, "blocks_ok": 0, "blocks_failed": 0, "bytes_loaded": 0,
                       "bytes_stored": 0}
        self._closed = False

    # ------------------------------------------------------------------ public API

    def store(self, block_ids: BlockIds, slots: Sequence[int], *,
              keys: Sequence[Hashable] | None = None) -> TransferHandle:
        """Copy device blocks into host slots that are WRITING (from ``HostTier.allocate``).  With
        ``keys``, on completion the ok slots are committed with their keys and the failed ones freed, so
        a failed store is never visible; without, the caller commits ``result.ok_slots`` itself."""
        if keys is not None and len(keys) != len(block_ids):
            raise ValueError(f"store: {len(block_ids)} block ids but {len(keys)} keys")
        return self._submit(Direction.STORE, block_ids, slots, False, keys)

    def load(self, slots: Sequence[int], block_ids: BlockIds, *, layerwise: bool = True,
             keys: Sequence[Hashable] | None = None) -> TransferHandle:
        """Copy READY host slots into device blocks; with ``layerwise`` each layer is signalled as soon as
        it lands (``handle.wait_layer``).  With ``keys``, a slot that no longer holds its key (evicted
        and refilled since the lookup) fails its block instead of loading someone else's KV."""
        if keys is not None and len(keys) != len(block_ids):
            raise ValueError(f"load: {len(block_ids)} block ids but {len(keys)} keys")
        return self._submit(Direction.LOAD, block_ids, slots, layerwise, keys)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def close(self, wait: bool = True) -> None:
        """Stop accepting batches; with ``wait``, return once those already submitted have finished
        (they finish either way)."""
        self._closed = True
        # Issuing pools first: their batches hand completions to the completion pools.
        pools = list(dict.fromkeys(self._issue.values()))
        pools += list(self._complete.values()) if self._cuda else []
        for p in pools:
            p.shutdown(wait=wait)  # queued batches still run: cancelling them would strand their waiters

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _submit(self, direction: Direction, block_ids: BlockIds, slots: Sequence[int], layerwise: bool,
                keys: Sequence[Hashable] | None) -> TransferHandle:
        if self._closed:
            raise RuntimeError("TransferEngine is closed")
        ids = int_array(block_ids, "block_ids")
        sl = int_array(slots, "slots")
        if ids.size != sl.size:
            raise ValueError(f"{direction}: {ids.size} block ids but {sl.size} slots")
        h = TransferHandle(direction, ids.tolist(), sl.tolist(), self.device.layout.num_layers,
                           self.device.device)
        ok, errors = self._validate(direction, ids, sl)
        if direction is Direction.LOAD and ok.any():
            # A slot evicted or refilled since the caller's lookup fails its block here instead of being
            # read while it is reused.
            idx = np.flatnonzero(ok)
            got = self.host.holds(sl[idx].tolist(), None if keys is None else [keys[i] for i in idx])
            lost = [int(sl[i]) for i, g in zip(idx, got) if not g]
            if lost:
                errors.append(f"slots not {READY.value}" + (" with their keys" if keys else "") + f": {lost}")
                ok[[i for i, g in zip(idx, got) if not g]] = False
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device.device))
        batch = _Batch(h, ids, sl, ok, errors, layerwise, keys, ready, time.perf_counter())
        try:
            self._issue[direction].submit(self._run, batch)
        except RuntimeError as e:  # executor shut down
            self._fail_all(batch, f"not submitted: {e}")
        return h

    def _validate(self, direction: Direction, ids: np.ndarray, sl: np.ndarray) -> tuple[np.ndarray, list[str]]:
        ok = self.device.valid_block_ids(ids)
        errors = []
        if not ok.all():
            errors.append(f"block ids out of range [0, {self.device.num_blocks}): {ids[~ok].tolist()}")
        in_range = (sl >= 0) & (sl < self.host.num_slots)
        if not in_range.all():
            errors.append(f"slots out of range [0, {self.host.num_slots}): {sl[~in_range].tolist()}")
        ok &= in_range
        if direction is Direction.STORE:  # (a load's slots are checked against their keys in _submit)
            states = np.array(self.host.in_state(sl.tolist(), WRITING), dtype=bool)
            if (in_range & ~states).any():
                errors.append(f"slots not {WRITING.value}: {sl[in_range & ~states].tolist()}")
            ok &= states
        # The destination of each block must be unique, or which copy wins is undefined: the first
        # valid occurrence is kept.
        dst = sl if direction is Direction.STORE else ids
        cand = np.flatnonzero(ok)
        keep = np.zeros_like(ok)
        keep[cand[np.unique(dst[cand], return_index=True)[1]]] = True
        if (ok & ~keep).any():
            errors.append(f"duplicate destinations: {dst[ok & ~keep].tolist()}")
        return ok & keep, errors

    def _run(self, batch: _Batch) -> None:
        h, ok, errors = batch.handle, batch.ok, batch.errors
        good_ids, good_sl = batch.ids[ok], batch.slots[ok]
        try:
            if self._cuda:
                final = self._issue_cuda(h, good_ids, good_sl, batch.layerwise, batch.ready)
                try:
                    self._complete[h.direction].submit(self._complete_cuda, batch, final)
                except RuntimeError:  # closing: complete here
                    self._complete_cuda(batch, final)
                return
            self._copy(h, good_ids, good_sl, batch.layerwise)
        except Exception as e:  # noqa: BLE001 - a worker fault fails blocks, never the caller
            log.warning("%s of %d blocks failed: %s", h.direction, len(good_ids), e)
            errors.append(f"{type(e).__name__}: {e}")
            ok = np.zeros_like(ok)
            if self._cuda:
                # Copies issued before the fault may still be running: the slots and blocks are not
                # released (freed, reported done) until they have stopped.
                try:
                    self._streams[h.direction].synchronize()
                except Exception as e2:  # noqa: BLE001
                    errors.append(f"{type(e2).__name__}: {e2}")
        self._finish(batch, ok, errors)

    def _layers(self, h: TransferHandle, layerwise: bool) -> list[Sequence[int] | None]:
        return [[i] for i in range(h.counter.num_layers)] if layerwise else [None]

    def _copy(self, h: TransferHandle, ids: np.ndarray, sl: np.ndarray, layerwise: bool) -> None:
        """CPU: copy (layer by layer if asked), marking each layer as it lands."""
        plan = self.device.plan(ids, self.host.slab, sl)
        for layers in self._layers(h, layerwise):
            if h._cancel.is_set():
                raise RuntimeError("cancelled")
            if h.direction is Direction.LOAD:
                self.device.scatter(self.host.slab, ids, sl, layers=layers, plan=plan)
            else:
                self.device.gather(ids, self.host.slab, sl, layers=layers, plan=plan)
            self._mark(h, layers, None)

    def _mark(self, h: TransferHandle, layers: Sequence[int] | None, event: Any) -> None:
        if layers is None:
            h.counter.mark_all_done(event)
            return
        h.counter.mark_layer_done(layers[0], event)
        if self.layer_hook is not None:
            self.layer_hook(h.direction, layers[0])

    def _issue_cuda(self, h: TransferHandle, ids: np.ndarray, sl: np.ndarray, layerwise: bool,
                    ready: Any) -> Any:
        stream = self._streams[h.direction]
        with torch.cuda.device(self.device.device), torch.cuda.stream(stream):
            stream.wait_event(ready)  # after the compute already queued by the caller
            # Whole-block copies stage at most max_staging_bytes at a time; layer-wise ones stage one
            # layer of the batch at a time.
            step = max(len(ids), 1) if layerwise else self._chunk
            plans = [self.device.plan(ids[a:a + step], self.host.slab, sl[a:a + step])
                     for a in range(0, len(ids), step)]
            for layers in self._layers(h, layerwise):
                if h._cancel.is_set():
                    raise RuntimeError("cancelled")
                for p in plans:
                    if h.direction is Direction.LOAD:
                        self.device.scatter(self.host.slab, None, layers=layers, plan=p)
                    else:
                        self.device.gather(None, self.host.slab, layers=layers, plan=p)
                ev = torch.cuda.Event()
                ev.record(stream)
                self._mark(h, layers, ev)
            final = torch.cuda.Event()
            final.record(stream)
            return final

    def _complete_cuda(self, batch: _Batch, final: Any) -> None:
        ok, errors = batch.ok, batch.errors
        try:
            final.synchronize()
        except Exception as e:  # noqa: BLE001 - a CUDA fault fails the batch
            errors.append(f"{type(e).__name__}: {e}")
            ok = np.zeros_like(ok)
        self._finish(batch, ok, errors)

    def _fail_all(self, batch: _Batch, why: str) -> None:
        batch.errors.append(why)
        self._finish(batch, np.zeros_like(batch.ok), batch.errors)

    def _finish(self, batch: _Batch, ok: np.ndarray, errors: list[str]) -> None:
        """The batch's outcome: ``ok`` and ``errors`` are its final ones (a fault after submission may
        have replaced the submitted ``batch.ok`` with all False)."""
        h, ids, sl, keys = batch.handle, batch.ids, batch.slots, batch.keys
        try:
            if keys is not None and h.direction is Direction.STORE:
                good = np.flatnonzero(ok).tolist()
                self.host.commit([int(sl[i]) for i in good], [keys[i] for i in good])
                # Free the failed slots this batch was filling (still WRITING); a slot that was in another
                # state (or out of range) was never ours to fill.
                failed = {int(s) for s, k in zip(sl, ok) if not k and 0 <= s < self.host.num_slots}
                failed -= {int(sl[i]) for i in good}
                self.host.free([s for s in sorted(failed) if self.host.state(s) == WRITING])
        except Exception as e:  # noqa: BLE001
            log.error("%s: host bookkeeping failed: %s", h.direction, e)
            errors.append(f"host bookkeeping: {e}")
        n_ok = int(ok.sum())
        nbytes = n_ok * self.device.block_nbytes
        with self._lock:
            s = self._stats
            s["loads" if h.direction is Direction.LOAD else "stores"] += 1
            s["blocks_ok"] += n_ok
            s["blocks_failed"] += len(ids) - n_ok
            s["bytes_loaded" if h.direction is Direction.LOAD else "bytes_stored"] += nbytes
        h._finish(TransferResult(h.direction, h.block_ids, h.slots, tuple(bool(x) for x in ok),
                                 tuple(errors), time.perf_counter() - batch.t0, nbytes))


def _wait_event(event: Any, deadline: float | None, what: str) -> None:
    if deadline is None:
        event.synchronize()
        return
    while not event.query():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: copies issued but not complete by the deadline")
        time.sleep(_POLL_S)


def _call(fn: Callable[[TransferResult], None], result: TransferResult) -> None:
    try:
        fn(result)
    except Exception:  # noqa: BLE001 - a callback's fault is its own
        log.exception("transfer done-callback failed")

"""``kvtier verify --config FILE [--fix]``: read every stored block of the config's namespaces and check it.

Only this deployment's namespaces are listed and read (see ``kvtier inspect``); ``--all-namespaces``
checks every block of the store, other deployments' included.

Each block is checked as a read by the tier stack would: the stored length, every header field (magic,
version, lengths, namespace digest, block key, layout id, header checksum) and the payload checksum, and
its payload length against the namespace's layout.  The layout id expected comes from the namespace's
manifest; a namespace without a (valid) manifest is still checked against everything else, taking the
layout id from each block's own header, and the output says its layout could not be cross-checked.

Without ``--fix`` nothing is changed (a plain read by the stack would delete a corrupt block; verify does
not).  With ``--fix`` each corrupt block is read and checked once more, then deleted if it still fails.
A block that vanishes while verify runs (evicted or deleted by another process) is counted, not reported
as corrupt; one rewritten meanwhile is checked again.  Exit status 0 when no corrupt block is left and
every backend was read, 1 otherwise, 2 for a bad config or flag.

A backend whose ``security`` mode is authenticate or encrypt is checked as its reads check (with the
config's ``security.keys``): a value it would refuse with an intact header (unsealed, sealed in another
mode or with a key this deployment does not hold, or a bad tag) is reported as FORGED, apart from the
corrupt ones, and ``--fix`` deletes it too."""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...backend_api import BackendError, StorageBackend, StoredBlock
from ...format import blockformat
from ...security import Forged
from ...units import format_size
from . import _storage_tools as st

BATCH_BLOCKS = 64
BATCH_BYTES = 64 << 20


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verify", help="read and check every stored block; --fix deletes corrupt ones",
                       description=__doc__)
    st.add_common_arguments(p)
    p.add_argument("--fix", action="store_true", help="delete the corrupt blocks found")
    p.set_defaults(func=run)


@dataclass
class Checker:
    """Reads and checks blocks of one backend with the raw read hook (no delete-on-corrupt)."""

    backend: StorageBackend
    infos: dict[str, st.NamespaceInfo]
    changed: int = 0
    vanished: int = 0
    ok: int = 0
    bytes_read: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)

    def _read(self, blocks: list[StoredBlock]) -> list[tuple[int | None, bytearray, bytearray]]:
        b = self.backend
        hsize = b.header_size
        headers = [bytearray(hsize) for _ in blocks]
        payloads = [bytearray(max(x.size - hsize, 0)) for x in blocks]
        sizes = b._call(b._read_into, [x.key for x in blocks], [memoryview(h) for h in headers],
                        [memoryview(p) for p in payloads])
        return list(zip(sizes, headers, payloads))

    def why(self, key: str, size: int, header: bytearray, payload: bytearray) -> str | None:
        """Why the value read is not ``key``'s block (None if it is)."""
        hsize = self.backend.header_size
        if size < hsize:
            return f"stored value is {size} bytes, shorter than the {hsize}-byte header"
        info = self.infos[key.partition("/")[0]]
        layout_id = info.layout_id if info.layout_id is not None else st.header_layout_id(header)
        view = memoryview(payload)
        full: bytes | bytearray = header
        pad = blockformat.ALIGNED_HEADER_SIZE - blockformat.HEADER_SIZE
        if (self.backend.seal is None and blockformat.stated_header_size(header) == blockformat.ALIGNED_HEADER_SIZE
                and len(payload) >= pad):
            # An aligned value (its header says 4096 bytes): the raw read put the rest of its header at the
            # front of the payload buffer; checked as a reader of the layout checks it, padding included.
            full, view = bytes(header) + bytes(view[:pad]), view[pad:]
        why = self.backend._verify(key, size, full, view, layout_id)
        payload_len = view.nbytes
        want = info.payload_nbytes
        if why is None and want is not None and payload_len != want:
            why = f"payload is {payload_len} bytes; the namespace's layout has {want}-byte blocks"
        return why

    def check(self, blocks: list[StoredBlock], retry: bool = True) -> list[tuple[str, str]]:
        """Check a batch; returns its corrupt (key, why) and updates the counters."""
        found: list[tuple[str, str]] = []
        again: list[StoredBlock] = []
        for blk, (size, header, payload) in zip(blocks, self._read(blocks)):
            if size is None:
                self.vanished += 1
            elif size != blk.size:  # rewritten since it was listed: read it again at its new size
                if retry:
                    again.append(StoredBlock(blk.key, size))
                else:
                    self.changed += 1
            else:
                self.bytes_read += size
                why = self.why(blk.key, size, header, payload)
                if why is None:
                    self.ok += 1
                else:
                    found.append((blk.key, why))
        if again:
            found += self.check(again, retry=False)
        self.corrupt += found
        return found


def _batches(blocks: list[StoredBlock]) -> Iterator[list[StoredBlock]]:
    batch: list[StoredBlock] = []
    nbytes = 0
    for blk in blocks:
        if batch and (len(batch) >= BATCH_BLOCKS or nbytes + blk.size > BATCH_BYTES):
            yield batch
            batch, nbytes = [], 0
        batch.append(blk)
        nbytes += blk.size
    if batch:
        yield batch


def verify_backend(ob: st.OpenedBackend, args: argparse.Namespace, scope: st.Scope) -> dict[str, Any]:
    entry = ob.header()
    if ob.backend is None:
        return entry
    b = ob.backend
    try:
        by_ns: dict[str, list[StoredBlock]] = defaultdict(list)
        if scope.all:
            for blk in b.scan():
                by_ns[blk.key.partition("/")[0]].append(blk)
            others = 0
        else:  # only the namespaces in scope are listed and read
            ids, others = scope.ids(b)
            for ns in ids:
                by_ns[ns].extend(b.scan(ns))
                if not by_ns[ns]:
                    del by_ns[ns]
        listed = [blk for blocks in by_ns.values() for blk in blocks]
        infos = {ns: st.namespace_info(b, ns) for ns in sorted(by_ns)}
        unchecked = {ns: info.problem for ns, info in infos.items() if info.layout_id is None}
        if not args.json:
            total = sum(blk.size for blk in listed)
            print(f"backend {ob.name}: checking {len(listed)} blocks ({format_size(total)}) "
                  f"in {len(by_ns)} namespace{'s' if len(by_ns) != 1 else ''}")
            if others:
                print(f"  ({scope.others_line(others)})")
            for ns, problem in unchecked.items():
                print(f"  namespace {ns}: {problem}; its {len(by_ns[ns])} blocks are checked against "
                      "everything but the layout, which could not be cross-checked (layout id taken from "
                      "each block's header)")
        checker = Checker(b, infos)
        with st.progress(args, total=len(listed), unit="block", desc=f"verify {ob.name}") as bar:
            for ns in infos:
                for batch in _batches(by_ns[ns]):
                    for key, why in checker.check(batch):
                        if not args.json:
                            st.say(bar, f"  {'FORGED' if isinstance(why, Forged) else 'CORRUPT'} {key}: {why}")
                    bar.update(len(batch))
        deleted: list[str] = []
        if args.fix and checker.corrupt:
            # Check once more right before deleting: a writer may have replaced a block meanwhile.
            size_of = {blk.key: blk.size for blk in listed}
            again = Checker(b, infos)
            for batch in _batches([StoredBlock(key, size_of[key]) for key, _ in checker.corrupt]):
                again.check(batch)
            deleted = [key for key, _ in again.corrupt]
            if deleted:
                b.delete(deleted)
    except BackendError as e:
        entry["error"] = st.error_text(e)
        if not args.json:
            print(f"backend {ob.name}: ERROR: {entry['error']}")
        return entry
    entry.update({
        "blocks": len(listed), "checked": checker.ok + len(checker.corrupt), "ok": checker.ok,
        "bytes_checked": checker.bytes_read,
        "corrupt": [{"key": k, "reason": why} for k, why in checker.corrupt if not isinstance(why, Forged)],
        "forged": [{"key": k, "reason": why} for k, why in checker.corrupt if isinstance(why, Forged)],
        "deleted": deleted, "vanished": checker.vanished, "changed": checker.changed,
        "layout_not_cross_checked": unchecked, "other_namespaces": others,
    })
    if not args.json:
        line = (f"backend {ob.name}: {entry['checked']} blocks checked, {len(entry['corrupt'])} corrupt"
                + (f", {len(entry['forged'])} forged" if ob.backend is not None and b.seal is not None else "")
                + (f", {len(deleted)} deleted" if args.fix else ""))
        if checker.vanished:
            line += f", {checker.vanished} vanished while verifying"
        if checker.changed:
            line += f", {checker.changed} rewritten while verifying (not checked)"
        print(line)
    return entry


def run(args: argparse.Namespace) -> int:
    loaded = st.load(args)
    cfg = loaded.cfg
    if loaded.filled is not None and not args.json:
        print(loaded.across_namespaces(args.config, "checking each block against its own namespace's "
                                                    "manifest and header, across"))
    with st.open_backends(cfg, args.backend) as opened:
        entries = []
        for i, ob in enumerate(opened):
            if i and not args.json:
                print()
            if ob.error and not args.json:
                print(f"backend {ob.name} ({ob.conf.type}): ERROR: {ob.error}")
            entries.append(verify_backend(ob, args, loaded.scope))
    forged = sum(len(e.get("forged", ())) for e in entries)
    corrupt = sum(len(e.get("corrupt", ())) for e in entries) + forged
    left = corrupt - sum(len(e.get("deleted", ())) for e in entries)
    failed = [e["name"] for e in entries if e["error"]]
    if args.json:
        st.emit_json({"config": args.config, "corrupt": corrupt - forged, "forged": forged, "corrupt_left": left,
                      "failed_backends": failed,
                      "backends": entries})
    else:
        print()
        if corrupt == 0:
            print("verify: no corrupt blocks" + (f"; could not read {', '.join(failed)}" if failed else ""))
        else:
            where = sum(1 for e in entries if e.get("corrupt") or e.get("forged"))
            tail = (f"{corrupt - left} deleted" + (f", {left} still there" if left else "")) if args.fix \
                else "run with --fix to delete them"
            what = f"{corrupt - forged} corrupt, {forged} forged" if forged else f"{corrupt} corrupt"
            print(f"verify: {what} block{'s' if corrupt != 1 else ''} in {where} "
                  f"backend{'s' if where != 1 else ''}; {tail}"
                  + (f"; could not read {', '.join(failed)}" if failed else ""))
    return 1 if left or failed else 0

"""Point-to-point with NCCL's rules on gloo: a CPU run that would hang on NCCL fails instead.

gloo buffers sends and pairs messages by tag, so a program whose order of ``isend`` / ``irecv``
would deadlock on NCCL passes on gloo (see :mod:`epas_megatron.runtime.p2p_rules` for the rules
and why). :func:`install` replaces ``torch.distributed``'s point-to-point calls (``isend``,
``irecv``, ``send``, ``recv``, ``batch_isend_irecv``) in this process with ones that still move
the data through gloo but complete only when NCCL's rules would let them:

* every call is published to the job's rendezvous store (``torch.distributed``'s default store),
  and every rank keeps a :class:`~epas_megatron.runtime.p2p_rules.Progress` of what all ranks
  posted, so each one judges the same way which calls have started and completed;
* a ``Work``'s ``wait()`` returns once its call has completed under the rules; one batch is one
  call (as NCCL's coalesced work);
* messages are paired in posting order per channel, tags ignored: a pair whose tags, shapes or
  dtypes differ raises :class:`~epas_megatron.runtime.p2p_rules.MessageMismatch`;
* when every rank of the job waits on a call that cannot complete with what has been posted, the
  waiting ranks raise :class:`~epas_megatron.runtime.p2p_rules.WouldDeadlock` at once, naming each
  rank and the ops it waits on; a wait that lasts past the timeout (``EPAS_P2P_RULES_TIMEOUT``,
  seconds, default 60: some rank is elsewhere, e.g. in a collective) raises it too;
* the collectives a run issues on a group (``all_reduce``, ``broadcast``, ``barrier``,
  ``all_gather``, ``all_gather_object``, ``broadcast_object_list``) first wait for this rank's
  batched calls on that group: on NCCL they run on the same communicator's stream, after them.

``EPAS_P2P_RULES=nccl`` in the environment installs it when
:func:`epas_megatron.runtime.distributed.init_distributed` starts the process group (how the
tests run multi-process runs under it, and how a user checks a new schedule on CPU). It is a
checking tool: every message also waits for store round trips, so it is slower than plain gloo.
Under it the data is moved by gloo with tags of its own (the message's number on its channel), so
what arrives is what NCCL's pairing would deliver.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from epas_megatron.runtime.p2p_rules import RECV, SEND, Call, MessageMismatch, Op, Progress, WouldDeadlock

__all__ = ["ENV", "install", "uninstall", "installed", "install_from_env", "MessageMismatch", "WouldDeadlock"]

ENV = "EPAS_P2P_RULES"
"""``nccl``: install the transport when the process group starts."""

TIMEOUT_ENV = "EPAS_P2P_RULES_TIMEOUT"

_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list")
_ORIGINAL: dict[str, object] = {}
_TRANSPORT: Optional["_Transport"] = None


def installed() -> bool:
    return _TRANSPORT is not None


def install(timeout: Optional[float] = None) -> None:
    """Make this process's point-to-point calls follow NCCL's rules (after ``init_process_group``;
    every rank of the job must install it). Idempotent."""
    global _TRANSPORT
    if _TRANSPORT is not None:
        return
    if not dist.is_initialized():
        raise RuntimeError("the NCCL-rules transport needs an initialised process group")
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, "60"))
    _TRANSPORT = _Transport(c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), timeout)
    for name in _P2P + _COLLECTIVES:
        _ORIGINAL[name] = getattr(c10d, name)
    replacements = {"isend": _isend, "irecv": _irecv, "send": _send, "recv": _recv, "batch_isend_irecv": _batch_isend_irecv}
    replacements.update({name: _draining(name) for name in _COLLECTIVES})
    for name, function in replacements.items():
        setattr(c10d, name, function)  # P2POp checks its op against c10d's own isend / irecv
        setattr(dist, name, function)


def uninstall() -> None:
    global _TRANSPORT
    for name, function in _ORIGINAL.items():
        setattr(c10d, name, function)
        setattr(dist, name, function)
    _ORIGINAL.clear()
    _TRANSPORT = None


def install_from_env() -> None:
    """:func:`install` if ``EPAS_P2P_RULES=nccl`` and the process group runs on gloo (on NCCL its
    own rules apply: a note on standard error says the transport stays out); any other non-empty
    value is refused."""
    value = os.environ.get(ENV, "")
    if value and value != "nccl":
        raise ValueError(f"{ENV}={value!r}: the rules this transport follows are 'nccl' (or leave it unset)")
    if not value:
        return
    if dist.get_backend() != "gloo":
        if dist.get_rank() == 0:
            print(f"note: {ENV}=nccl is a check for gloo; this process group runs on {dist.get_backend()}, whose own rules "
                  "apply", file=sys.stderr, flush=True)
        return
    install()


class _Transport:
    """This rank's view of every rank's posts, kept in step through the store."""

    def __init__(self, store, rank: int, world: int, timeout: float):
        self.store = dist.PrefixStore("epas-p2p-rules/", store)
        self.rank, self.world, self.timeout = rank, world, timeout
        self.progress = Progress()
        self.read = [0] * world  # posts of each rank already in self.progress
        self.store.set(f"state/{rank}", "run")

    # ------------------------------------------------------------------ posting
    def post(self, call: Call, tensors: list[torch.Tensor], group) -> "_Work":
        try:
            index = self.progress.post(self.rank, call)
        except MessageMismatch as error:
            self._fail(error)
        self.read[self.rank] += 1
        # one round trip: the call, then the count that makes it visible (a reader that sees the
        # count before the call's key blocks in get() until it is there)
        self.store.multi_set([f"call/{self.rank}/{index}", f"count/{self.rank}"], [json.dumps(
            {"group": call.group, "batched": call.batched, "ops": [[op.kind, op.peer, op.label] for op in call.ops]}),
            str(index + 1)])
        inner = []
        for k, (op, tensor) in enumerate(zip(call.ops, tensors)):
            tag = 2 * self.progress.slot(self.rank, index, k) + (1 if call.batched else 0)
            function = _ORIGINAL["isend"] if op.kind == SEND else _ORIGINAL["irecv"]
            peer = {"dst": op.peer} if op.kind == SEND else {"src": op.peer}
            inner.append(function(tensor, group=group, tag=tag, **peer))
        return _Work(self, index, inner)

    def refresh(self) -> None:
        """Read every other rank's new posts: one round trip per rank for its count, one for all
        the new calls together."""
        new = []
        for rank in range(self.world):
            if rank != self.rank:
                new.extend((rank, i) for i in range(self.read[rank], int(self.store.add(f"count/{rank}", 0))))
        if not new:
            return
        for (rank, _), text in zip(new, self.store.multi_get([f"call/{rank}/{i}" for rank, i in new])):
            data = json.loads(text)
            ops = tuple(Op(kind, peer, label) for kind, peer, label in data["ops"])
            self.read[rank] += 1
            try:
                self.progress.post(rank, Call(ops, data["group"], data["batched"]))
            except MessageMismatch as error:
                self._fail(error)

    # ------------------------------------------------------------------ waiting
    def completed(self, index: int) -> bool:
        if self.progress.completed(self.rank, index):  # posting more never undoes a completion: no store traffic
            return True
        self.refresh()
        self.progress.settle()
        return self.progress.completed(self.rank, index)

    def wait_for(self, index: int) -> None:
        if self.completed(index):
            return
        start = time.monotonic()
        deadline, pause, announced = start + self.timeout, 1e-4, False
        try:
            while True:
                if time.monotonic() - start < 0.05:  # most waits end here, with no more store traffic
                    # polls at most every millisecond: a peer's post is seen within about 1 ms (a
                    # longer pause is time the wait outlasts the peer, on every pipeline message)
                    time.sleep(pause)
                    pause = min(2 * pause, 1e-3)
                    if self.completed(index):
                        return
                    continue
                if not announced:  # a wait that lasts: say so, and look for a deadlock
                    self.store.set(f"state/{self.rank}", f"wait {index}")
                    announced = True
                states = [state.decode() for state in self.store.multi_get([f"state/{r}" for r in range(self.world)])]
                if self.completed(index):
                    return
                self._check_failed()
                waiting = {r: int(s.split()[1]) for r, s in enumerate(states) if s.startswith("wait")}
                if len(waiting) == self.world and not any(self.progress.completed(r, i) for r, i in waiting.items()):
                    self._fail(WouldDeadlock(self.progress.deadlock_report(waiting)))
                if time.monotonic() > deadline:
                    self._fail(WouldDeadlock(self.progress.deadlock_report({**waiting, self.rank: index}) +
                                             f"\n  (no progress for {self.timeout:g} s; {TIMEOUT_ENV} sets it; ranks not listed "
                                             "are elsewhere, e.g. in a collective)"))
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
        finally:
            if announced:
                self.store.set(f"state/{self.rank}", "run")

    def drain(self, group) -> None:
        """Wait for this rank's batched calls on ``group`` (a collective runs after them on NCCL)."""
        name = _group_name(group)
        calls = self.progress.calls.get(self.rank, [])
        for index in range(len(calls) - 1, -1, -1):
            if calls[index].batched and calls[index].group == name:
                self.wait_for(index)
                return

    def _fail(self, error: Exception):
        self.store.set("failed", f"rank {self.rank}: {type(error).__name__}: {error}")
        raise error

    def _check_failed(self) -> None:
        if self.store.check(["failed"]):
            raise WouldDeadlock(f"another rank stopped the run under NCCL's rules -- {self.store.get('failed').decode()}")


class _Work:
    """One call's ``Work`` (``wait`` / ``is_completed``): done when its call has completed under
    the rules and gloo has moved its data."""

    def __init__(self, transport: _Transport, index: int, inner: list):
        self.transport, self.index, self.inner = transport, index, inner

    def wait(self, timeout=None) -> bool:
        self.transport.wait_for(self.index)
        for work in self.inner:
            work.wait()
        self.inner = []  # the sent tensors are the caller's again
        return True

    def is_completed(self) -> bool:
        return self.transport.completed(self.index) and all(work.is_completed() for work in self.inner)

    def exception(self):
        return None


def _group_name(group) -> str:
    return (group if group is not None else c10d._get_default_group()).group_name


def _global_peer(group, peer: Optional[int], group_peer: Optional[int]) -> int:
    if peer is None and group_peer is None:
        raise ValueError("under NCCL's rules a receive names its source (NCCL has no receive from any rank)")
    if peer is None:
        return dist.get_global_rank(group, group_peer) if group is not None else group_peer
    return peer


def _label(tensor: torch.Tensor, tag: int) -> str:
    return f"tag {tag} {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _post(kind: str, tensor, peer, group, tag, group_peer, batched=False) -> _Work:
    peer = _global_peer(group, peer, group_peer)
    call = Call((Op(kind, peer, _label(tensor, tag)),), _group_name(group), batched=batched)
    return _TRANSPORT.post(call, [tensor], group)


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _post(SEND, tensor, dst, group, tag, group_dst)


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _post(RECV, tensor, src, group, tag, group_src)


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _isend(tensor, dst, group, tag, group_dst).wait()


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    peer = _global_peer(group, src, group_src)
    _irecv(tensor, peer, group, tag).wait()
    return peer


def _batch_isend_irecv(p2p_op_list) -> list:
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv of no ops")
    group = p2p_op_list[0].group
    if any(op.group is not group for op in p2p_op_list):
        raise ValueError("batch_isend_irecv: all ops need to use the same group (as torch requires)")
    ops = []
    for op in p2p_op_list:
        kind = SEND if op.op in (_isend, _ORIGINAL["isend"]) else RECV
        ops.append(Op(kind, _global_peer(group, op.peer, op.group_peer), _label(op.tensor, op.tag)))
    return [_TRANSPORT.post(Call(tuple(ops), _group_name(group), batched=True), [op.tensor for op in p2p_op_list], group)]


def _draining(name: str):
    original = _ORIGINAL[name]
    signature = inspect.signature(original)

    def collective(*args, **kwargs):
        if _TRANSPORT is not None:
            _TRANSPORT.drain(signature.bind_partial(*args, **kwargs).arguments.get("group"))
        return original(*args, **kwargs)

    collective.__name__ = name
    collective.__doc__ = f"``torch.distributed.{name}`` after this rank's batched calls on its group (NCCL's order)."
    return collective


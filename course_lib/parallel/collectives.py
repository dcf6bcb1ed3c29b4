"""Ring all-reduce built from point-to-point send/recv, with every byte counted (lesson 02).

The ring algorithm (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; popularised for deep learning by Baidu's "ring all-reduce" and Horovod, Sergeev & Del
Balso 2018) splits a tensor of N elements into n chunks, one per rank, and runs two phases around a ring
rank r -> r+1 -> ... -> r:

1. reduce-scatter, n-1 steps: at step s rank r sends chunk (r - s) mod n to its right neighbour and adds
   the chunk (r - s - 1) mod n received from its left neighbour into its own copy. Afterwards rank r holds
   the complete sum of chunk (r + 1) mod n.
2. all-gather, n-1 steps: at step s rank r sends chunk (r + 1 - s) mod n (complete) and overwrites chunk
   (r - s) mod n with the one it receives.

Each rank sends 2(n-1) chunks, so 2(n-1)/n x the tensor's bytes when n divides N: almost twice the
tensor whatever the number of ranks, which is why the ring is *bandwidth optimal*. `ring_bytes_sent`
gives the exact count for any N (chunks differ by at most one element when n does not divide N).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from course_lib.reference import reference_for

__all__ = ["ByteCounter", "chunk_sizes", "batch_send_recv", "send_recv", "ring_all_reduce", "ring_bytes_sent", "ring_bytes_formula"]


@dataclasses.dataclass
class ByteCounter:
    """Bytes and messages one rank sent through point-to-point calls (lesson 02)."""

    bytes_sent: int = 0
    messages: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()
        self.messages += 1


@reference_for("00-partial-sum")
def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of the n ring chunks of a tensor of `numel` elements: as `torch.tensor_split` makes them
    (the first numel % n chunks get one element more; chunks may be empty when numel < n)."""
    base, extra = divmod(numel, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def ring_bytes_sent(numel: int, n: int, rank: int, element_size: int = 4) -> int:
    """Exact bytes rank `rank` sends in a ring all-reduce of `numel` elements over n ranks.

    Reduce-scatter sends every chunk except (rank+1) mod n, all-gather every chunk except (rank+2) mod n:
    bytes = element_size x (2 numel - c[(rank+1) % n] - c[(rank+2) % n]). Summed over ranks: 2(n-1) x bytes.
    """
    if n == 1:
        return 0
    c = chunk_sizes(numel, n)
    return element_size * (2 * numel - c[(rank + 1) % n] - c[(rank + 2) % n])


def ring_bytes_formula(nbytes: int, n: int) -> float:
    """The textbook per-rank traffic of a ring all-reduce: 2(n-1)/n x the tensor's bytes."""
    return 2 * (n - 1) / n * nbytes


def _global(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (send/recv take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def batch_send_recv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                    group=None) -> None:
    """Send every ``(tensor, dst)`` and receive into every ``(buffer, src)`` (global ranks), all posted together with
    ``dist.batch_isend_irecv`` and waited for (empty tensors are skipped). NCCL runs the messages between two ranks in
    one queue: a send and a receive between the same two ranks posted apart can wait on each other there (a deadlock
    that gloo forgives, `course_lib.runtime.nccl_rules`), so every set of messages that travels together goes here (lessons
    02 and 03)."""
    ops = [dist.P2POp(dist.isend, t, dst, group) for t, dst in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, buf, src, group) for buf, src in recvs if buf.numel()]
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()


def send_recv(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None,
              group=None) -> None:
    """Send `send` to global rank `dst` while receiving into `recv` from global rank `src` (`batch_send_recv` of
    one message each way; None is skipped)."""
    batch_send_recv([(send, dst)] if send is not None else [], [(recv, src)] if recv is not None else [], group)


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group,
              counter: ByteCounter | None) -> None:
    """One ring step: send to `right` while receiving from `left` (`send_recv`). Every rank of the ring posts its
    send before anyone waits (a ring of blocking sends could deadlock), and at 2 ranks, where right == left, the send
    and the receive travel as one group."""
    if counter is not None and send.numel():
        counter.add(send)
    send_recv(send, right, recv, left, group)


@reference_for("02-ring-all-reduce")
@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, group=None, counter: ByteCounter | None = None,
                    average: bool = False) -> torch.Tensor:
    """Sum (or average) `tensor` over the ranks of `group`, in place, with a ring of send/recv (lesson 02).

    Works for any shape and number of elements (uneven chunks included) and any world size (1 returns
    the tensor unchanged). `counter` (a `ByteCounter`) receives every byte this rank sends. Returns `tensor`.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return tensor.div_(1) if average else tensor
    r = dist.get_rank(group)
    right, left = _global(group, (r + 1) % n), _global(group, (r - 1) % n)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)                         # any shape -> (N,), a view
    chunks = list(torch.tensor_split(flat, n))   # n views of sizes chunk_sizes(N, n)
    buf = torch.empty_like(chunks[0])            # the largest chunk

    for s in range(n - 1):                       # 1. reduce-scatter: n-1 steps
        send, recv = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        incoming = buf[: recv.numel()]
        _exchange(send, incoming, right, left, group, counter)
        recv.add_(incoming)                      # partial sum of this chunk grows by one rank
    for s in range(n - 1):                       # 2. all-gather: n-1 steps, complete chunks travel
        send, recv = chunks[(r + 1 - s) % n], chunks[(r - s) % n]
        _exchange(send, recv, right, left, group, counter)

    if average:
        flat.div_(n)
    if work is not tensor:                       # a non-contiguous input was worked on in a copy
        tensor.copy_(work)
    return tensor

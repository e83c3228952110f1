"""Communication for parallel prefill, one small object per style.

- ``AllGather`` (TSP): ``all_gather(k, v)`` gives every rank every rank's
  K and V. Chunks may differ in size; gloo's all_gather needs equal ones, so
  it pads to the longest chunk and trims afterwards.
- ``Chain`` (KV-Runahead): point-to-point links to the neighbours. ``recv``
  and ``send`` block; ``irecv`` posts a receive and returns a handle to
  ``wait()`` on later, ``isend`` queues a send and only waits for the
  previous one to be delivered (one message in flight per link).
- ``Ring`` (ring attention): every rank sends to rank+1 and receives from
  rank-1 at once; ``pass_on`` sends the block in hand and posts the receive
  of the next, ``return_partials`` sends pass-Q's partial outputs straight
  back to the ranks whose queries they answer.

All record what they do on the rank's ``Timeline`` (all-gathers, waits,
sends) and can act out a slower network with a ``LinkModel``, so the
algorithms in ``toyllm.parallel.steps`` stay free of that bookkeeping. Like
ring-flash-attention's RingComm, they hide ``send/recv/wait`` behind a few
verbs the algorithm reads naturally.

The simulated link acts as ``toyllm.simulate`` models it. The sender draws a
message's modelled time once, bytes / bandwidth + latency (times the
noise), and sends its delivery time, t_sent + that, with the data; the
receiver does not hand the message over before then, and the sender's next
message on that link does not leave before then either (a blocking send
returns only then). Each wait is for the later of the real transfer and the
modelled one, so a modelled link slower than the real one replaces it. The
sender's clock travels with the data, so the link model is for runs on one
machine (one clock) only.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention import partial_attention, runs
from ..timeline import Timeline


@dataclass(frozen=True)
class LinkModel:
    """A simulated network link: transfer time = bytes / bandwidth + latency, times a noise factor.

    bandwidth_gbps: gigabytes per second (1e9 bytes/s). latency_s: seconds per
    message. noisy_link: (src, dst) ranks whose link gets noise; noise: the
    standard deviation of the relative slow-down (0.5 = typically 50 percent
    slower); noise is never negative.
    """

    bandwidth_gbps: float
    latency_s: float = 0.0
    noisy_link: tuple[int, int] | None = None
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise ValueError(f"bandwidth must be a finite number > 0 GB/s, got {self.bandwidth_gbps}")
        if not (self.latency_s >= 0 and self.noise >= 0):
            raise ValueError(f"latency_s and noise must be >= 0, got {self.latency_s} and {self.noise}")

    def transfer_s(self, nbytes: int, src: int, dst: int, rng: random.Random) -> float:
        t = nbytes / (self.bandwidth_gbps * 1e9) + self.latency_s
        if self.noise and self.noisy_link in ((src, dst), (dst, src)):
            t *= 1.0 + abs(rng.gauss(0.0, self.noise))
        return t


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Comm:
    """What both styles share: the rank, the timeline, the simulated link."""

    def __init__(self, rank: int, chunks: list[int], timeline: Timeline, link: LinkModel | None = None,
                 rng: random.Random | None = None):
        self.rank, self.chunks, self.world_size = rank, list(chunks), len(chunks)
        self.tl, self.link, self.rng = timeline, link, rng or random.Random(0)
        self.layer: int | None = None      # set by the runner before each layer, for the timeline
        self._sending: list = []           # requests of the sends in flight
        self._delivery = 0.0               # their latest modelled delivery time (a perf_counter value; 0: none)

    def _hold_until(self, t_perf: float) -> None:
        """Simulated link: hold the data until its modelled arrival time (a perf_counter value)."""
        t0 = self.tl.now()
        delay = t_perf - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
            self.tl.add("link_delay", t0, self.tl.now(), self.layer)

    def _wait_delivered(self, layer: int | None = None) -> None:
        """Wait until the sends in flight are delivered, really and (simulated link) by the model."""
        if not self._sending:
            return
        t0 = self.tl.now()
        for r in self._sending:
            r.wait()
        self._sending = []
        delay = self._delivery - time.perf_counter()
        if self.link is not None and delay > 0:
            time.sleep(delay)
        self.tl.add("send_wait", t0, self.tl.now(), layer)

    def drain(self) -> None:
        """Wait for anything still in flight (called once after the last layer)."""
        self._wait_delivered()


class AllGather(_Comm):
    """TSP's collective: every rank ends up with the K and V of every chunk."""

    def all_gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's k, v (B, Hkv, c_i, D) in; every rank's (B, Hkv, c_j, D), in rank order, out."""
        kv = torch.stack([k, v])                                          # (2, B, Hkv, c_i, D): one message
        longest = max(self.chunks)
        if kv.shape[-2] < longest:                                        # equal sizes for all_gather: pad
            kv = torch.cat([kv, kv.new_zeros(*kv.shape[:-2], longest - kv.shape[-2], kv.shape[-1])], dim=-2)
        t0 = self.tl.now()
        if self.link is not None:                                         # everyone learns when the last rank arrived
            stamps = [torch.zeros(1, dtype=torch.float64) for _ in self.chunks]
            dist.all_gather(stamps, torch.tensor([time.perf_counter()], dtype=torch.float64))
        parts = [torch.empty_like(kv) for _ in self.chunks]
        dist.all_gather(parts, kv.contiguous())
        self.tl.add("allgather", t0, self.tl.now(), self.layer)
        if self.link is not None:                                         # a ring all-gather: p-1 steps of one chunk
            p = self.world_size
            step = max(self.link.transfer_s(nbytes(kv), r, (r + 1) % p, self.rng) for r in range(p))
            self._hold_until(max(s.item() for s in stamps) + (p - 1) * step)
        parts = [part[..., :c, :] for part, c in zip(parts, self.chunks)]   # trim the padding
        return [part[0] for part in parts], [part[1] for part in parts]


class _Incoming:
    """A posted receive; ``wait()`` returns what its comm makes of the message (Chain: the prefix's
    (k, v), each (B, Hkv, s_i, D); Ring: the block's tensors)."""

    def __init__(self, chain: "Chain", requests, stamp, buf):
        self.chain, self.requests, self.stamp, self.buf = chain, requests, stamp, buf
        self.posted_s = chain.tl.now()          # when the receive was posted (seconds on the timeline)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = self.chain.tl.now()
        for r in self.requests:
            r.wait()
        self.chain.tl.add("recv_wait", t0, self.chain.tl.now(), self.chain.layer,
                          f"irecv posted at {self.posted_s:.6f} s")
        return self.chain._arrived(self.stamp, self.buf)


class Chain(_Comm):
    """KV-Runahead's links: receive the prefix from rank-1, send the grown prefix to rank+1.

    Message shapes are known in advance: rank i receives K and V of the
    s_i tokens before its chunk, stacked as (2, B, Hkv, s_i, D).
    """

    def __init__(self, rank: int, chunks: list[int], timeline: Timeline, *, batch: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device=None, link: LinkModel | None = None,
                 rng: random.Random | None = None):
        super().__init__(rank, chunks, timeline, link, rng)
        self.prefix_shape = (2, batch, n_kv_heads, sum(chunks[:rank]), head_dim)
        self.send_shape = (batch, n_kv_heads, sum(chunks[:rank + 1]), head_dim)    # the grown prefix
        self.dtype, self.device = dtype, device
        self.has_prev, self.has_next = rank > 0, rank < len(chunks) - 1

    # ---------------------------------------------------------------- receiving
    def _buffers(self):
        stamp = torch.zeros(1, dtype=torch.float64)      # the modelled delivery time, on the sender's clock
        return stamp, torch.empty(self.prefix_shape, dtype=self.dtype, device=self.device)

    def _arrived(self, stamp, buf):
        if self.link is not None:
            self._hold_until(stamp.item())
        return buf[0], buf[1]

    def irecv(self) -> _Incoming | None:
        """Post the receive of the prefix from rank-1 and return at once (None on rank 0)."""
        if not self.has_prev:
            return None
        stamp, buf = self._buffers()
        return _Incoming(self, [dist.irecv(stamp, self.rank - 1), dist.irecv(buf, self.rank - 1)], stamp, buf)

    def recv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block until the prefix (k, v) from rank-1 is here (None on rank 0)."""
        if not self.has_prev:
            return None
        stamp, buf = self._buffers()
        t0 = self.tl.now()
        dist.recv(stamp, self.rank - 1)
        dist.recv(buf, self.rank - 1)
        self.tl.add("recv_wait", t0, self.tl.now(), self.layer, "recv")
        return self._arrived(stamp, buf)

    # ---------------------------------------------------------------- sending
    def _message(self, k, v):
        # The receiver's buffer has the size the partition implies; a smaller message would leave the rest
        # of it as garbage, with no error, so the size is checked here, on the sender.
        for label, t in (("keys", k), ("values", v)):
            if tuple(t.shape) != self.send_shape:
                r, s, c = self.rank, sum(self.chunks[:self.rank]), self.chunks[self.rank]
                raise ValueError(f"rank {r}, layer {self.layer}: the {label} sent to rank {r + 1} have shape "
                                 f"{tuple(t.shape)}, expected (batch, kv heads, s_{r} + c_{r} = {s} + {c}, "
                                 f"head_dim) = {self.send_shape}: is the prefix you pass on the grown one "
                                 "(what you received plus your own keys), not just your own?")
        kv = torch.stack([k, v]).contiguous()
        delivery = time.perf_counter()
        if self.link is not None:              # one draw per message: the receiver holds it until the same time
            delivery += self.link.transfer_s(nbytes(kv), self.rank, self.rank + 1, self.rng)
        self._delivery = delivery
        return torch.tensor([delivery], dtype=torch.float64), kv

    def isend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue k, v (B, Hkv, s_i + c_i, D) for rank+1 and return; no-op on the last rank."""
        if not self.has_next:
            return
        self._wait_delivered(self.layer)       # the previous layer's send must be delivered first
        t0 = self.tl.now()
        stamp, kv = self._message(k, v)
        self._sending = [dist.isend(stamp, self.rank + 1), dist.isend(kv, self.rank + 1)]
        self._keep = (stamp, kv)               # the buffers must live until the send completes
        self.tl.add("send", t0, self.tl.now(), self.layer)

    def send(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send k, v to rank+1 and return once delivered; no-op on the last rank."""
        if not self.has_next:
            return
        t0 = self.tl.now()
        stamp, kv = self._message(k, v)
        dist.send(stamp, self.rank + 1)
        dist.send(kv, self.rank + 1)
        if self.link is not None:              # a blocking send holds the sender until the modelled delivery
            self._hold_until(self._delivery)
        self.tl.add("send", t0, self.tl.now(), self.layer)


class Ring(_Comm):
    """Ring attention's links: every rank sends to rank+1 and receives from rank-1, all at once.

    At ring step s rank r holds the block that started on rank (r - s) mod p
    (``origin``); ``pass_on`` sends it on and posts the receive of the next
    one, whose size the partition gives, so the algorithm computes on the
    block in hand while the next travels. Pass-Q also sends each partial
    output straight back to the rank whose queries it answers
    (``return_partials``). Continuing a cache, ``held`` is this rank's shard
    of the earlier tokens' KV cache (a ``DynamicKVCache``), ``held_layout``
    every rank's cached positions, and ``block_tokens`` the tokens of each
    rank's block when it is not its chunk (pass-KV sends the cached ones too).
    """

    def __init__(self, rank: int, chunks: list[int], timeline: Timeline, link: LinkModel | None = None,
                 rng: random.Random | None = None, held=None, held_layout: list[torch.Tensor] | None = None,
                 layout: list[torch.Tensor] | None = None, block_tokens: list[int] | None = None):
        super().__init__(rank, chunks, timeline, link, rng)
        self.held_layout = held_layout or []                  # every rank's cached positions, in rank order
        self.held_pos = self.held_layout[rank] if held_layout else None
        self.block_tokens = list(block_tokens or chunks)      # tokens of the block each rank sends round
        self.first_positions = {int(t[0]): r for r, t in enumerate(layout or [])}   # names a block by its rank
        self.next, self.prev = (rank + 1) % self.world_size, (rank - 1) % self.world_size
        self.held = held
        self._keep: list = []        # buffers of the sends in flight: they must live until delivered

    def origin(self, step: int) -> int:
        """The rank whose tokens the block in hand at ring step ``step`` holds."""
        return (self.rank - step) % self.world_size

    def held_kv(self):
        """This rank's cached keys, values (B, Hkv, n_r, D) of the current layer and their positions (n_r,)."""
        k, v = self.held.keys(self.layer), self.held.values(self.layer)
        return k, v, self.held_pos

    def attend(self, q, k, v, q_pos, k_pos, attention, label: str | None = None):
        """Attention of q (B, H, T, D) over one block k, v (B, Hkv, S, D): out (B, H, T, D), lse (B, H, T).

        The compute of one ring step, recorded on the timeline as "attention
        over block r" (r: the rank the block started on, when the ring was
        given every rank's positions, ``layout``), else by the keys' positions. A kernel that skips
        masked work (``attention.skips_masked``) gets fused calls wherever a
        pair of runs needs no mask (``toyllm.attention.partial_attention``).
        """
        if label is None:
            origin = self.first_positions.get(int(k_pos[0]))
            label = (f"attention over block {origin}" if origin is not None else
                     "attention over keys " + ", ".join(f"{int(k_pos[a])}-{int(k_pos[b - 1])}" for a, b in runs(k_pos)))
        with self.tl.span("compute", self.layer, label):
            return partial_attention(q, k, v, q_pos, k_pos, getattr(attention, "skips_masked", False))

    def pass_on(self, step: int, *block: torch.Tensor) -> "_Incoming":
        """Send ``block`` (tensors of equal shape, tokens on dim -2) to rank+1; receive the next from rank-1.

        Returns the posted receive: ``wait()`` gives the block of the next
        step's origin as a tuple of as many tensors.
        """
        self._wait_delivered(self.layer)      # one block in flight per link: the last one must be delivered
        t0 = self.tl.now()
        message = torch.stack(block)                                     # (n, B, heads, c_origin, D): one message
        shape = (*message.shape[:-2], self.block_tokens[self.origin(step + 1)], message.shape[-1])
        # With two ranks both messages of a step cross one pair, and NCCL runs a pair's operations in the order
        # they were posted: the lower rank sends first and the higher receives first, or both would wait to
        # receive. (Gloo takes them in any order.)
        if self.rank < self.next:
            self._post(message, self.next)
            incoming = self._receive(shape, message, self.prev)
        else:
            incoming = self._receive(shape, message, self.prev)
            self._post(message, self.next)
        self.tl.add("send", t0, self.tl.now(), self.layer, f"ring step {step}")
        return incoming

    def return_partials(self, partials: dict) -> list:
        """Send partials[o] = (out, lse) to rank o, receive every rank's for this rank's queries.

        out (B, H, c_o, D) and lse (B, H, c_o) travel as one message, lse as
        an extra column, so in one dtype: bfloat16 outputs beside a float32
        lse travel as float32, twice the bytes ``ring_traffic`` counts for
        them at 2 bytes per value. Returns this rank's (out, lse) pairs, its
        own first.
        """
        self._wait_delivered(self.layer)
        mine = partials[self.rank]
        t0 = self.tl.now()
        packed = torch.cat([mine[0], mine[1][..., None]], dim=-1)[None]   # (1, B, H, c_r, D + 1)
        incoming = []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            out, lse = partials[peer]
            answer = torch.cat([out, lse[..., None]], dim=-1)[None].contiguous()
            # one pair, two messages: the lower rank sends first (see pass_on)
            if self.rank < peer:
                self._post(answer, peer)
                incoming.append(self._receive(packed.shape, packed, peer))
            else:
                incoming.append(self._receive(packed.shape, packed, peer))
                self._post(answer, peer)
        self.tl.add("send", t0, self.tl.now(), self.layer, "partial outputs")
        got = [mine]
        for arriving in incoming:
            (both,) = arriving.wait()
            got.append((both[..., :-1], both[..., -1]))
        return got

    def _receive(self, shape, like: torch.Tensor, src: int) -> "_Incoming":
        stamp = torch.zeros(1, dtype=torch.float64)      # the modelled delivery time, on the sender's clock
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        return _Incoming(self, [dist.irecv(stamp, src), dist.irecv(buf, src)], stamp, buf)

    def _post(self, message: torch.Tensor, dst: int) -> None:
        delivery = time.perf_counter()
        if self.link is not None:              # one draw per message: the receiver holds it until the same time
            delivery += self.link.transfer_s(nbytes(message), self.rank, dst, self.rng)
        self._delivery = max(self._delivery, delivery)
        stamp = torch.tensor([delivery], dtype=torch.float64)
        self._keep += [stamp, message]
        self._sending += [dist.isend(stamp, dst), dist.isend(message, dst)]

    def _wait_delivered(self, layer: int | None = None) -> None:
        super()._wait_delivered(layer)
        self._keep = []

    def _arrived(self, stamp, buf):
        if self.link is not None:
            self._hold_until(stamp.item())
        return tuple(buf.unbind(0))

"""Tensor parallelism inside predd, on torch.distributed (gloo on CPU, nccl on CUDA).

Megatron-style: every rank holds its share of the query heads (q, and the matching
columns of o_proj), of the KV heads (k, v, and the KV pool, by heads, with the same page
ids on every rank) and of the MLP's columns (gate/up; the rows of down_proj); attention
and MLP outputs are summed over the ranks (one all-reduce each). Embeddings, norms and
the LM head are whole on every rank; only rank 0 computes logits. When the ranks
outnumber the KV heads, each KV head is kept by `world / kv_heads` ranks (as vLLM does).

Rank 0 is predd: it serves ZeroMQ, schedules, owns every page table, capability and
quota, and sends the other ranks each command as small integer tensors (`Link`): a
step's chunks, a page copy, a read or write of entries (whole-head data, gathered from
or scattered to the ranks, so exports and tiers see the TP-independent layout). The
other ranks only compute (`serve_rank`). A collective that fails or waits past
TIMEOUT_S raises `RankLost`: every rank then exits with one line saying so; rank 0 pings
when idle so the others notice a dead or hung rank 0 too.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from predd.engine.chunk import Chunk
from predd.model.loader import ModelConfig

TIMEOUT_S = 30.0         # a collective waiting longer means a rank died or hangs
JOIN_TIMEOUT_S = 900.0   # ranks load the model before they meet: allow for a big one
PING_S = 5.0             # rank 0 sends at least this often, so idle ranks see it live

STEP, COPY, READ, WRITE, PING, STOP = range(6)


class RankLost(RuntimeError):
    """A tensor parallel rank died or stopped answering: predd cannot go on."""


@dataclass(frozen=True)
class Layout:
    """Which part of the model one rank holds: [start, stop) of the query heads, the
    KV heads and the MLP's intermediate columns."""
    world: int
    rank: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    columns: tuple[int, int]


def layout(cfg: ModelConfig, world: int, rank: int) -> Layout:
    """Rank `rank`'s part of `cfg` at `--tp world`; ValueError (EINVAL) when the model
    cannot be split that way."""
    h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if world < 1:
        raise ValueError(f"--tp must be at least 1, not {world} (EINVAL)")
    if h % world:
        raise ValueError(f"--tp {world} does not divide the model's {h} query heads (EINVAL)")
    if inter % world:
        raise ValueError(f"--tp {world} does not divide the model's MLP width {inter} (EINVAL)")
    if world <= kv and kv % world:
        raise ValueError(f"--tp {world} does not divide the model's {kv} KV heads (EINVAL)")
    if world > kv and world % kv:
        raise ValueError(f"--tp {world} is above the model's {kv} KV heads and not a "
                         "multiple of them (EINVAL)")
    per_q, per_col = h // world, inter // world
    first_kv = rank * kv // world
    kv_heads = (first_kv, first_kv + max(1, kv // world))
    return Layout(world, rank, (rank * per_q, (rank + 1) * per_q), kv_heads,
                  (rank * per_col, (rank + 1) * per_col))


def local_config(cfg: ModelConfig, lay: Layout) -> ModelConfig:
    """The model as one rank holds it (its heads and columns)."""
    return replace(cfg, num_heads=lay.heads[1] - lay.heads[0],
                   num_kv_heads=lay.kv_heads[1] - lay.kv_heads[0],
                   intermediate_size=lay.columns[1] - lay.columns[0])


def part_of(world: int, rank: int):
    """The loader's `part` for this rank: (dim, start, stop) of a Hugging Face weight
    (ValueError, EINVAL, from `layout` when the model cannot be split `world` ways)."""
    def of(cfg: ModelConfig, name: str) -> tuple[int, int, int] | None:
        lay, d = layout(cfg, world, rank), cfg.head_dim
        if ".self_attn.q_proj." in name:
            return 0, lay.heads[0] * d, lay.heads[1] * d
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return 0, lay.kv_heads[0] * d, lay.kv_heads[1] * d
        if name.endswith(".self_attn.o_proj.weight"):
            return 1, lay.heads[0] * d, lay.heads[1] * d
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return 0, *lay.columns
        if name.endswith(".mlp.down_proj.weight"):
            return 1, *lay.columns
        return None
    return of


BACKENDS = ("auto", "gloo", "nccl")


def backend_for(requested: str, device: str) -> str:
    """`--dist-backend`: auto is nccl on CUDA, gloo on CPU; nccl needs CUDA (ValueError
    with an errno-named message)."""
    if requested not in BACKENDS:
        raise ValueError(f"--dist-backend must be one of {', '.join(BACKENDS)}, not "
                         f"{requested!r} (EINVAL)")
    if requested == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if requested == "nccl" and not device.startswith("cuda"):
        raise ValueError(f"--dist-backend nccl needs a CUDA device, not {device} (EINVAL)")
    return requested


def join(world: int, rank: int, device: str, backend: str = "auto"):
    """Joins the ranks (rendezvous from torchrun's environment: MASTER_ADDR, MASTER_PORT)
    and returns the group every command runs on, with TIMEOUT_S per collective."""
    import torch.distributed as dist
    backend = backend_for(backend, device)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    return dist.new_group(list(range(world)), backend=backend,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _guard(what: str, call):
    try:
        return call()
    except RankLost:
        raise
    except Exception as exc:      # gloo raises RuntimeError; a closed peer, a timeout
        raise RankLost(f"tensor parallel {what} failed: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


# ------------------------------------------------------------------ commands

def encode_chunks(chunks) -> np.ndarray:
    """A step's chunks as one int64 array: count, then per chunk its four sizes, then
    tokens, positions, pages and wanted rows."""
    parts = [np.array([len(chunks)], np.int64)]
    for c in chunks:
        parts.append(np.array([len(c.tokens), len(c.pages), c.kv_len, len(c.outputs)], np.int64))
        parts += [np.asarray(a, np.int64) for a in (c.tokens, c.positions, c.pages, c.outputs)]
    return np.concatenate(parts)


def decode_chunks(flat: np.ndarray) -> list[Chunk]:
    count, at, chunks = int(flat[0]), 1, []
    for _ in range(count):
        n, pages, kv_len, outs = (int(v) for v in flat[at:at + 4])
        at += 4
        tokens, positions = flat[at:at + n], flat[at + n:at + 2 * n]
        at += 2 * n
        table, wanted = flat[at:at + pages], flat[at + pages:at + pages + outs]
        at += pages + outs
        chunks.append(Chunk(tokens, positions, table, kv_len, wanted))
    return chunks


class Link:
    """The commands between rank 0 and the others, over `group`."""

    def __init__(self, group, device: torch.device) -> None:
        import torch.distributed as dist
        self.dist, self.group, self.device = dist, group, device
        self.last_sent = time.monotonic()

    def send(self, op: int, payload: np.ndarray | None = None) -> None:
        """Rank 0: the command `op` with its int64 payload."""
        payload = np.zeros(0, np.int64) if payload is None else np.asarray(payload, np.int64)
        header = torch.tensor([op, len(payload)], dtype=torch.int64, device=self.device)
        _guard("send", lambda: self.dist.broadcast(header, 0, group=self.group))
        if len(payload):
            body = torch.from_numpy(payload).to(self.device)
            _guard("send", lambda: self.dist.broadcast(body, 0, group=self.group))
        self.last_sent = time.monotonic()

    def receive(self) -> tuple[int, np.ndarray]:
        """Another rank: the next command."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        _guard("receive", lambda: self.dist.broadcast(header, 0, group=self.group))
        op, size = (int(v) for v in header.tolist())
        body = torch.zeros(size, dtype=torch.int64, device=self.device)
        if size:
            _guard("receive", lambda: self.dist.broadcast(body, 0, group=self.group))
        return op, body.cpu().numpy()

    def keepalive(self) -> None:
        if time.monotonic() - self.last_sent >= PING_S:
            self.send(PING)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        _guard("all-reduce", lambda: self.dist.all_reduce(x, group=self.group))
        return x

    def gather(self, tensor: torch.Tensor, world: int) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's `tensor` (all the same shape), the others None."""
        rank = self.dist.get_rank(self.group)
        out = [torch.empty_like(tensor) for _ in range(world)] if rank == 0 else None
        _guard("gather", lambda: self.dist.gather(tensor, out, dst=0, group=self.group))
        return out

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        _guard("broadcast", lambda: self.dist.broadcast(tensor, 0, group=self.group))
        return tensor


def _wire(array: np.ndarray) -> torch.Tensor:
    """numpy K/V (bf16 as uint16 bits) as a tensor gloo carries (int16 for those bits)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.int16) if tensor.dtype == torch.uint16 else tensor


class ShardedCache:
    """Rank 0's `PageData` over the pool of every rank: page ops go to all ranks; reads
    gather whole heads, writes scatter them, so the KV store, tiers and exports see the
    layout one rank would have."""

    def __init__(self, local, link: Link, layouts: list[Layout], full: ModelConfig) -> None:
        self.local, self.link, self.layouts, self.full = local, link, layouts, full
        self.page_size = local.page_size
        # the first rank that holds each KV head gives it on reads
        self.sources = [r for r, lay in enumerate(layouts)
                        if r == 0 or lay.kv_heads[0] >= layouts[r - 1].kv_heads[1]]

    @property
    def bytes_per_page(self) -> int:
        return self.local.bytes_per_page // self.local.cfg.num_kv_heads * self.full.num_kv_heads

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src) == 0:
            return
        self.link.send(COPY, np.concatenate([[len(src)], src, dst]))
        self.local.copy_slots(src, dst)

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        mine = self.local.read_slots(slots)
        if len(slots) == 0:            # nothing to gather: the whole heads' empty shape
            shape = list(mine.shape)
            shape[3] = self.full.num_kv_heads
            return np.zeros(shape, mine.dtype)
        self.link.send(READ, slots)
        parts = self.link.gather(_wire(mine), len(self.layouts))
        whole = np.concatenate([parts[r].numpy() for r in self.sources], axis=3)
        return whole.view(mine.dtype)

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        if len(slots) == 0:
            return
        self.link.send(WRITE, slots)
        self.link.broadcast(_wire(data))
        kv0, kv1 = self.layouts[0].kv_heads
        self.local.write_slots(slots, data[:, :, :, kv0:kv1])

    def describe(self) -> dict:
        return {**self.local.describe(), "kv_heads": self.full.num_kv_heads}


def serve_rank(runner, link: Link, log) -> None:
    """A rank other than 0: carry out rank 0's commands until STOP (or RankLost)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a terminal's ^C: rank 0 says STOP
    cache, lay, full = runner.cache, runner.layout, runner.model_config
    while True:
        op, payload = link.receive()
        if op == STEP:
            runner.compute(decode_chunks(payload))
        elif op == COPY:
            n = int(payload[0])
            cache.copy_slots(payload[1:1 + n], payload[1 + n:])
        elif op == READ:
            link.gather(_wire(cache.read_slots(payload)), lay.world)
        elif op == WRITE:
            dtype = np.dtype(cache.describe()["numpy_dtype"])
            shape = (full.num_layers, 2, len(payload), full.num_kv_heads, full.head_dim)
            data = link.broadcast(_wire(np.empty(shape, dtype))).numpy().view(dtype)
            cache.write_slots(payload, data[:, :, :, lay.kv_heads[0]:lay.kv_heads[1]])
        elif op == STOP:
            log(f"rank {lay.rank}: stopping")
            return


# ------------------------------------------------------------------ launching

def ranks(world: int, argv: list[str]) -> tuple[int, list]:
    """(this process's rank, the processes it started). Under torchrun the environment
    names the rank (and must agree with `--tp`); otherwise this process is rank 0 and
    starts ranks 1 .. world-1 as `python -m predd ARGV` on this host, meeting on a free
    loopback port. ValueError (EINVAL) when torchrun started another number of ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        started = int(os.environ["WORLD_SIZE"])
        if started != world:
            raise ValueError(f"--tp {world}, but torchrun started {started} ranks (EINVAL)")
        return int(os.environ["RANK"]), []
    common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    from predd.server.launch import die_with_parent
    children = [subprocess.Popen([sys.executable, "-m", "predd", *argv],
                                 env={**os.environ, **common, "RANK": str(r),
                                      "LOCAL_RANK": str(r)},
                                 stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
                for r in range(1, world)]
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    return 0, children


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world: int) -> int:
    """This host's cores shared by the ranks on it (torchrun's LOCAL_WORLD_SIZE)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, (os.cpu_count() or 1) // local)


def ready() -> None:
    """Every rank has loaded its part: wait (up to JOIN_TIMEOUT_S) for the slowest."""
    import torch.distributed as dist
    _guard("start", lambda: dist.barrier())


def end(children: list, grace_s: float = 10.0) -> None:
    """Wait for the ranks this process started; kill the ones still there after grace_s."""
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except Exception:
            child.kill()
            child.wait()


def leave() -> None:
    """Take this process out of the ranks before it exits (after STOP, or when its
    peers are gone): torch.distributed aborts a process that exits with a live group."""
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:       # peers already gone: nothing left to close cleanly
            pass

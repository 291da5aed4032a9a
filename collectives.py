"""The collectives of tensor parallelism (all-reduce, all-gather, broadcast). On GPUs they
are NCCL's. One host's CPU ranks exchange through a shared-memory segment when the tensor
fits its slots (LLAMA_CPU_COLLECTIVES=gloo turns it off): gloo's loopback sockets cost
tens of times more for a decode step's all-reduce, and a decode step makes two per layer
(BENCHMARKS.md, tensor parallelism on CPU: gloo against shared memory). Larger tensors
(long prefill chunks) and other hosts' ranks use gloo.

Each rank owns one slot in each of two buffers and a counter of its exchanges. An
exchange writes the rank's tensor into its slot of buffer n % 2, publishes n, waits until
every rank has published n, then reads all slots in rank order, so every rank computes
the same bits. Two buffers suffice: a rank that writes buffer n % 2 again (exchange n + 2)
has seen every rank publish n + 1, which each does only after reading exchange n.

Each slot carries a stamp that checks this at run time, as a seqlock does: the writer
marks the slot begun (n) before its data and ended (n) after, with a signature of the
operation (kind, size, element size, source). A reader raises OutOfStep unless every
rank's slot says ended n with its own signature before it reads, and still begun n after:
ranks that make different collectives, or a slot written while it is read, are an error,
never a wrong sum."""

import contextlib
import functools
import logging
import mmap
import os
import platform
import threading
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

SLOT_BYTES = 1 << 20  # a rank's part of one buffer: 32 decode rows of dim 8192 in fp32
SPINS = 100  # polls before a waiting rank yields its core to whoever else needs it
YIELD_S, NAP_S = 0.002, 0.0001  # after 2 ms of waiting, sleep 0.1 ms between polls
LIVENESS_S = 0.5  # how often a waiting rank checks that the others are still alive
MESSAGE_BYTES = 4096  # what broadcast_bytes sends in one go
NO_TIMEOUT = timedelta(days=3650)  # the leader group's: TorchServe's responseTimeout catches a hang
SEGMENTS = "/dev/shm"  # where the segment's file is made: memory, not disk (tests set their own)

logger = logging.getLogger(__name__)

_channel: "SharedMemoryChannel | None" = None
REDUCE, GATHER, BROADCAST = range(3)  # the kinds of exchange, in its signature


class OutOfStep(RuntimeError):
    """The ranks' collectives disagree: their results cannot be trusted, nor the next ones."""


class SharedMemoryChannel:
    def __init__(self, slot_bytes: int = SLOT_BYTES):
        """Join the segment of the default process group's ranks (a collective call)."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slot_bytes = slot_bytes
        # a cache line per rank: its published count, then (begun, ended, signature) per buffer
        header = 64 * self.world_size
        size = header + 2 * self.world_size * slot_bytes
        with new_segment(size) if self.rank == 0 else contextlib.nullcontext() as path:
            path = broadcast_bytes(path.encode() if self.rank == 0 else None).decode()
            if not path:  # on every rank alike
                raise OSError(f"cannot make a shared-memory segment of {size} bytes in {SEGMENTS}")
            try:
                with open(path, "r+b") as f:
                    self.segment = mmap.mmap(f.fileno(), size)
            except OSError:
                self.segment = None
            opened = all_gather_bytes(b"1" if self.segment is not None else b"")
        # the file is gone now; the mappings stay until the ranks exit
        if not all(opened):  # on every rank alike
            raise OSError(f"ranks {[r for r, ok in enumerate(opened) if not ok]} cannot open {path}")
        self.words = memoryview(self.segment)[:header].cast("q")  # plain reads and writes, no numpy calls
        self.lines = range(0, 8 * self.world_size, 8)  # where each rank's line starts in words
        self.slots = torch.frombuffer(self.segment, dtype=torch.uint8, offset=header,
                                      count=2 * self.world_size * slot_bytes).view(2, self.world_size, slot_bytes)
        self.count = 0
        # With more ranks than cores, a rank that yields in its waits keeps taking a core from
        # the ranks it waits for: it naps at once (SmolLM2 at TP=3 on 2 cores, its served tests:
        # 44-47 s of the machine's CPU against 52-61)
        self.yield_s = YIELD_S if len(os.sched_getaffinity(0)) >= self.world_size else 0.0
        pids = all_gather_bytes(str(os.getpid()).encode())
        self.peers = {r: int(pid) for r, pid in enumerate(pids) if r != self.rank}
        self.fence = threading.Lock()

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def exchange(self, x: torch.Tensor, kind: int, read):
        """read(every rank's x, stacked (world_size, *x.shape) in rank order): a view of the
        segment, valid only while read runs."""
        self.count = count = self.count + 1
        buffer, n_bytes = count % 2, x.numel() * x.element_size()
        signature = n_bytes << 16 | x.element_size() << 8 | kind
        words, mine, at = self.words, 8 * self.rank, 1 + 3 * buffer  # at: the buffer's stamp in a line
        words[mine + at] = count  # begun: x86 keeps plain stores in order, so before the data
        parts = self.slots[buffer, :, :n_bytes].view(x.dtype).view(self.world_size, *x.shape)
        parts[self.rank].copy_(x)
        words[mine + at + 1], words[mine + at + 2] = count, signature  # ended
        with self.fence:  # a locked instruction: the copy's stores are visible before the counter's
            words[mine] = count
        self.wait(count)
        if any(words[line + at + 1] != count or words[line + at + 2] != signature for line in self.lines):
            raise OutOfStep(f"tensor-parallel ranks out of step at exchange {count} ({signature:#x} on rank "
                            f"{self.rank}): slots say (ended, signature) "
                            f"{[words[line + at + 1:line + at + 3].tolist() for line in self.lines]}")
        result = read(parts)
        if any(words[line + at] != count for line in self.lines):
            raise OutOfStep(f"a slot of exchange {count} was written again while rank {self.rank} read it: "
                            f"begun {[words[line + at] for line in self.lines]}")
        return result

    def wait(self, count: int):
        """Until every rank has published count: polling, then yielding the core to whoever
        else needs it, then, in a long wait (a rank busy elsewhere), sleeping between polls."""
        polls, begin = 0, time.monotonic()
        checked = begin
        words = self.words
        while any(words[line] < count for line in self.lines):
            polls += 1
            if polls <= SPINS:
                continue
            now = time.monotonic()
            if now - begin < self.yield_s:
                os.sched_yield()
            else:
                time.sleep(NAP_S)
            if now - checked > LIVENESS_S:
                self.check_peers()
                checked = now

    def check_peers(self):
        """Raise if a rank that this one waits for has died (gloo would see its socket close)."""
        for rank, pid in self.peers.items():
            if not alive(pid):
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {pid}) is gone")


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie has exited: only its parent has yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def requested() -> str:
    """What LLAMA_CPU_COLLECTIVES asks for CPU ranks: shm (the default) or gloo."""
    wanted = os.environ.get("LLAMA_CPU_COLLECTIVES", "shm")
    if wanted not in ("shm", "gloo"):
        raise ValueError(f"LLAMA_CPU_COLLECTIVES must be shm or gloo, got {wanted!r}")
    return wanted


def tp_world() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup():
    """Use shared memory for the default group's collectives when its ranks are this host's
    CPU processes (x86-64: the ordering of the segment's stores is reasoned for its memory
    model), unless LLAMA_CPU_COLLECTIVES=gloo. A collective call: every rank makes it."""
    global _channel
    if not (dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"):
        return
    wanted = requested()
    hosts = all_gather_bytes(platform.node().encode())
    if wanted == "shm" and len(set(hosts)) == 1 and platform.machine() in ("x86_64", "AMD64"):
        try:
            _channel = SharedMemoryChannel()
        except OSError as e:
            logger.warning("%s; the collectives go through gloo", e)


@contextlib.contextmanager
def new_segment(size: int):
    """Rank 0's new segment file for the block ("" if there is no room), removed when the
    block ends, however it ends (a rank that raises in set-up, or dies: then rank 0's next
    collective raises). First the files that crashed set-ups left go."""
    remove_stale_segments()
    path = make_segment(size) or ""
    try:
        yield path
    finally:
        if path:  # removed by another hand: raising on rank 0 alone, after the ranks agreed on
            with contextlib.suppress(FileNotFoundError):  # the segment, would send it alone to gloo
                os.unlink(path)


def segment_prefix() -> str:
    """The start of this pid namespace's segment names, llama-tp-<namespace>-<maker's pid>-:
    a pid is judged only by the /proc that shows it (a container that shares /dev/shm has
    its own pids)."""
    return f"llama-tp-{os.stat('/proc/self/ns/pid').st_ino}-"


def remove_stale_segments():
    """Remove the segment files whose makers are gone: a rank 0 killed in set-up leaves its
    file (4-8 MB of memory) behind. A living maker's file is in a set-up (another server's):
    it stays."""
    try:  # raising here, before the broadcast of the path, would leave the other ranks waiting
        names, prefix = os.listdir(SEGMENTS), segment_prefix()
    except OSError:  # no folder (make_segment finds no room), or no /proc to judge pids by
        return
    for name in names:
        pid = name[len(prefix):].split("-")[0]
        if name.startswith(prefix) and pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):  # another user's (/dev/shm is sticky), or just removed
                os.unlink(os.path.join(SEGMENTS, name))


def make_segment(size: int) -> str | None:
    """A new file of size bytes in SEGMENTS, its memory reserved (a full /dev/shm would
    otherwise fail later, at a write, with SIGBUS); None if there is no room."""
    try:  # a new file (never another's, nor a link), readable by this user only
        path = os.path.join(SEGMENTS, f"{segment_prefix()}{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return path
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def in_segment(x: torch.Tensor, group) -> bool:
    return _channel is not None and group in (None, dist.group.WORLD) and _channel.fits(x)


def all_reduce(x: torch.Tensor, group=None):
    """Sum x over the ranks, in place."""
    if in_segment(x, group):
        reduce_in_segment(x)
    else:
        dist.all_reduce(x, group=group)


def all_gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' x concatenated along the last dimension, in rank order."""
    if in_segment(x, group):
        return gather_in_segment(x)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, src: int = 0):
    """Rank src's x on every rank, in place."""
    if in_segment(x, None):
        _channel.exchange(x, BROADCAST | src << 2, lambda parts: x.copy_(parts[src]))
    else:
        dist.broadcast(x, src=src)


def reduce_in_segment(x: torch.Tensor):
    _channel.exchange(x, REDUCE, lambda parts: torch.sum(parts, dim=0, out=x))


def gather_in_segment(x: torch.Tensor) -> torch.Tensor:
    return _channel.exchange(x, GATHER, lambda parts: torch.cat(parts.unbind(0), dim=-1))


@functools.cache
def ops_in_graphs():
    """Inside a compiled step the segment's exchanges are operators of their own (torch.library
    custom ops, run as they are): a graph calls them in place. As graph breaks (two a layer)
    they split a step into many graphs, compiled apart, with Python between them: the demo's
    compiled TP=2 step took a third longer at one row and eight (docs/tuning-log.md), and
    its first compile a third longer. Called before compiling (runner.compile_decode):
    an eager call of an op costs about 8 us more than one of the function, two a layer."""
    global reduce_in_segment, gather_in_segment
    reduce, gather = reduce_in_segment, gather_in_segment

    @torch.library.custom_op("llama_tp::reduce_in_segment", mutates_args=("x",))
    def reduce_op(x: torch.Tensor) -> None:
        reduce(x)

    @reduce_op.register_fake
    def _(x):
        return None

    @torch.library.custom_op("llama_tp::gather_in_segment", mutates_args=())
    def gather_op(x: torch.Tensor) -> torch.Tensor:
        return gather(x)

    @gather_op.register_fake
    def _(x):
        return x.new_empty(*x.shape[:-1], x.shape[-1] * _channel.world_size)

    reduce_in_segment, gather_in_segment = reduce_op, gather_op


# --- rank 0's messages to the other ranks (handler.py: each iteration's batch) --------------

def leader_group():
    """A gloo group of every rank for rank 0's messages, on CPU and apart from the model's
    collectives, whose waits never time out: each rank waits there only until every rank
    has its copy of the batch from TorchServe, and a worker that hangs is TorchServe's to
    restart (responseTimeout in model-config.yaml). A collective call: every rank makes it."""
    return dist.new_group(backend="gloo", timeout=NO_TIMEOUT)


def broadcast_bytes(payload: bytes | None, group=None) -> bytes:
    """Rank 0's payload on every rank of group (the others pass None). One broadcast of
    MESSAGE_BYTES carries its length and a payload that fits (most batches: one broadcast
    costs about half of two); a longer one sends its rest after.
    The tensors view bytearrays, so the bytes need no numpy (not a runtime requirement)."""
    head_bytes = bytearray(MESSAGE_BYTES)
    if payload is not None:
        head_bytes[:8] = len(payload).to_bytes(8, "little")
        first = payload[:MESSAGE_BYTES - 8]
        head_bytes[8:8 + len(first)] = first
    dist.broadcast(torch.frombuffer(head_bytes, dtype=torch.uint8), src=0, group=group)
    size = int.from_bytes(head_bytes[:8], "little")
    if size <= MESSAGE_BYTES - 8:
        return bytes(head_bytes[8:8 + size])
    rest = bytearray(payload[MESSAGE_BYTES - 8:]) if payload is not None else bytearray(size - (MESSAGE_BYTES - 8))
    dist.broadcast(torch.frombuffer(rest, dtype=torch.uint8), src=0, group=group)
    return bytes(head_bytes[8:]) + bytes(rest)


def all_gather_bytes(payload: bytes, group=None) -> list[bytes]:
    """Every rank's payload in rank order (a collective call). torch's object collectives
    would need numpy, which is not a runtime requirement."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)]), group=group)
    longest = max(1, *(int(size) for size in sizes))  # torch.frombuffer takes no empty buffer
    buffers = [bytearray(longest) for _ in range(world)]
    mine = bytearray(payload.ljust(longest, b"\0"))
    dist.all_gather([torch.frombuffer(b, dtype=torch.uint8) for b in buffers], torch.frombuffer(mine, dtype=torch.uint8),
                    group=group)
    return [bytes(b[:int(size)]) for b, size in zip(buffers, sizes)]

"""Tensor parallelism: one worker's model split across `tensor_parallel_size` ranks.

Megatron's split of a Llama layer: each rank holds a contiguous range of KV heads with
their query heads (the qkv projection's rows, o_proj's columns, its own slice of every KV
page), a range of the MLP's intermediate units (gate and up rows, down's columns) or of a
Mixture-of-Experts' whole experts (expert parallelism: every rank routes every token, each
computes its own experts' weighted outputs), and a range of the vocabulary (embedding and
lm_head rows). A step sums o_proj's and down's partial outputs over the ranks (one
all-reduce per attention and per MLP block), the embedding's rows likewise, and gathers the
logits' vocabulary slices. Ranges need not be equal: SmolLM2-135M's 3 KV heads split
2 + 1 over two ranks. A quantized matrix's column ranges fall on its groups of 32.

The ranks of a worker run in Ray actors on one node (a STRICT_PACK placement group).
Rank 0 is the engine (scheduler, sampler, its own shard); before each forward it
broadcasts the step's layout (token ids, positions, slots, page table, logits rows) and
the other ranks, in `TensorRank.follow`, run the same forward on their shards and their
own KV caches, whose page ids are rank 0's. The ranks talk through torch.distributed
(gloo on CPU, NCCL on CUDA), over loopback, met through a file: nothing listens beyond
the node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from cluster.config import ConfigError, EngineConfig
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.model.checkpoint import ModelSpec, Weights
from cluster.engine.model.quantization import GROUP, Fp8Rows, GroupQuant, Stored
from cluster.engine.model.shared_collectives import SHM, PeerLost, SharedExchange
from cluster.types import PageId

if TYPE_CHECKING:
    from cluster.transfer.rank_endpoint import RankEndpoint
    from cluster.transfer.wire import RankPages

log = logging.getLogger(__name__)
IDLE_TIMEOUT = timedelta(days=7)  # gloo's: a follower waits this long for the next step
RANK_CPUS_WAIT_S = 10.0  # how long a driver's engine waits for Ray to free CPUs for its ranks
T = TypeVar("T")
HEADER = 6  # op, tokens, sequences, page table width, logits rows, decodes
STOP, STEP = 0, 1


def split(total: int, parts: int, unit: int) -> list[tuple[int, int]]:
    """[start, end) ranges of 0..total, one per part, each a multiple of `unit` long, as
    even as can be (the first ones take the remainder)."""
    units, rest = divmod(total, unit)
    assert rest == 0 and units >= parts, (total, parts, unit)
    base, extra = divmod(units, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + (base + (i < extra)) * unit
        ranges.append((start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model, as [start, end) ranges."""

    rank: int
    size: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]  # query heads: the KV heads' groups
    intermediate: tuple[int, int]  # (a Mixture-of-Experts': all, unused)
    experts: tuple[int, int]  # a Mixture-of-Experts' whole experts ((0, 0) for a dense MLP)
    vocab: tuple[int, int]
    vocab_widths: tuple[int, ...]  # every rank's vocabulary slice (the logits gather)

    @staticmethod
    def of(spec: ModelSpec, rank: int, size: int, quantized: bool) -> Shard:
        """Rank `rank`'s shard; ConfigError naming tensor_parallel_size when the model does
        not split that many ways (fewer KV heads than ranks, or a quantized matrix whose
        groups a range would cut)."""

        def refuse(why: str) -> ConfigError:
            return ConfigError(f"tensor_parallel_size: {size} ranks: {why}")

        if spec.num_kv_heads < size:
            raise refuse(f"the model has {spec.num_kv_heads} KV heads, one rank needs one")
        if spec.experts and spec.experts < size:
            raise refuse(f"the model has {spec.experts} experts, one rank needs one")
        unit = GROUP if quantized else 1
        dense = not spec.experts
        if dense and (spec.intermediate_size % unit or spec.intermediate_size // unit < size):
            raise refuse(
                f"the MLP's {spec.intermediate_size} units do not split into groups of {unit}"
            )
        kv = split(spec.num_kv_heads, size, 1)
        group = spec.num_heads // spec.num_kv_heads
        if quantized and any((a * group * spec.head_dim) % GROUP for a, _ in kv):
            raise refuse(f"o_proj's columns of {spec.head_dim}-wide heads cut its groups")
        vocab = split(spec.vocab_size, size, 1)
        return Shard(
            rank,
            size,
            kv[rank],
            (kv[rank][0] * group, kv[rank][1] * group),
            split(spec.intermediate_size, size, unit)[rank]
            if dense
            else (0, spec.intermediate_size),
            split(spec.experts, size, 1)[rank] if spec.experts else (0, 0),
            vocab[rank],
            tuple(b - a for a, b in vocab),
        )

    def describe(self) -> str:
        """For the start-up line: `rank 0 of 2 (KV heads 0-1, MLP units 0-767)` (or
        `experts 0-3`)."""
        (k0, k1), (i0, i1), (e0, e1) = self.kv_heads, self.intermediate, self.experts
        mlp = f"experts {e0}-{e1 - 1}" if e1 else f"MLP units {i0}-{i1 - 1}"
        return f"tensor parallel rank {self.rank} of {self.size} (KV heads {k0}-{k1 - 1}, {mlp})"

    @property
    def vocab_width(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def local(self, spec: ModelSpec) -> ModelSpec:
        """The shape this rank computes: its heads and MLP units (the vocabulary and the
        router's experts stay the model's, as gathered logits and routing have them)."""
        return dataclasses.replace(
            spec,
            num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
        )


def _rows(t: Stored, start: int, end: int) -> Stored:
    if isinstance(t, Fp8Rows):
        return Fp8Rows(t.codes[start:end].clone(), t.scale[start:end].clone())
    if isinstance(t, GroupQuant):
        q, scale, offset = (x[start:end].clone() for x in (t.q, t.scale, t.offset))
        return GroupQuant(q, scale, offset, t.bits, t.perm)
    return t[start:end].clone()


def _columns(t: Stored, start: int, end: int) -> Stored:
    if isinstance(t, Fp8Rows):  # a scale per output row: each rank's inputs keep it
        return Fp8Rows(t.codes[:, start:end].clone(), t.scale)
    if isinstance(t, GroupQuant):
        if t.perm is not None:
            raise ConfigError("tensor_parallel_size: act-order (desc_act) matrices do not split")
        assert start % GROUP == 0 and end % GROUP == 0, (start, end)
        g0, g1 = start // GROUP, end // GROUP
        return GroupQuant(
            t.q[:, start:end].clone(),
            t.scale[:, g0:g1].clone(),
            t.offset[:, g0:g1].clone(),
            t.bits,
        )
    return t[:, start:end].clone()


class ShardedWeights:
    """A checkpoint's tensors as one rank holds them: each matrix cut to its shard as it is
    taken (HF layout, [out, in]), the full tensor dropped."""

    def __init__(self, weights: Weights, shard: Shard, head_dim: int) -> None:
        self.weights, self.shard, self.head_dim = weights, shard, head_dim

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def pop(self, name: str) -> Stored:
        t, s, d = self.weights.pop(name), self.shard, self.head_dim
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if ".mlp.experts." in name:
            return t  # the rank's own experts, whole (the model takes no other's)
        if part == "q_proj":
            return _rows(t, s.heads[0] * d, s.heads[1] * d)
        if part in ("k_proj", "v_proj"):
            return _rows(t, s.kv_heads[0] * d, s.kv_heads[1] * d)
        if part == "o_proj":
            return _columns(t, s.heads[0] * d, s.heads[1] * d)
        if part in ("gate_proj", "up_proj"):
            return _rows(t, *s.intermediate)
        if part == "down_proj":
            return _columns(t, *s.intermediate)
        if part in ("embed_tokens", "lm_head"):
            return _rows(t, *s.vocab)
        return t  # the norms: every rank holds them whole


class GroupLost(BaseException):
    """A rank of this model's group is gone (its process died, or stopped answering within
    engine.collective_timeout_s): no step can run again. Not an Exception, so that no handler of one
    step's failure takes it for a request's: the worker ends, and its pool replaces it."""


@dataclass(frozen=True)
class GroupSettings:
    """How a group's ranks wait on one another."""

    backend: str  # the default group's: the step's collectives
    timeout: timedelta  # a collective of the default group that waits longer fails
    control_timeout: timedelta | None  # the gloo group of the steps' layouts; None: no group
    env: tuple[tuple[str, str], ...]  # set before the group starts (unless already set)


def group_settings(device: torch.device, collective_timeout_s: float) -> GroupSettings:
    """On a CPU, gloo: its default group also carries a follower's wait for the next step,
    as long as rank 0 lives (a dead peer's closed socket ends any wait at once). On CUDA,
    NCCL, whose kernels would wait for a lost rank forever: its collectives time out after
    `collective_timeout_s`, a blocking wait raising in the caller (GroupLost: the worker ends
    and its pool replaces it) and the watchdog's asynchronous error handling aborting the
    communicator and the process where a kernel waits still; the layouts go through gloo."""
    if device.type != "cuda":
        return GroupSettings("gloo", IDLE_TIMEOUT, None, ())
    env = (("TORCH_NCCL_BLOCKING_WAIT", "1"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    return GroupSettings("nccl", timedelta(seconds=collective_timeout_s), IDLE_TIMEOUT, env)


class TensorGroup:
    """One worker's ranks, joined: the collectives a sharded step runs, and rank 0's
    broadcast of each step's layout.

    On a CPU the collectives go through shared memory (shared_collectives.py), a tensor
    too large for it through gloo; on CUDA through NCCL. The step's layout goes through
    shared memory too, or a gloo group (NCCL's watchdog would end a rank idle too long).
    A rank waiting for the next step waits as long as rank 0 lives; one inside a step
    waits `collective_timeout_s` for the others (`group_settings`; gloo: a dead peer's
    closed socket ends it at once)."""

    def __init__(
        self, shard: Shard, store: str, device: torch.device, collective_timeout_s: float
    ) -> None:
        """Join the group (blocks until every rank has); `store` is a file all ranks see,
        in a directory of this group's own."""
        self.shard, self.device = shard, device
        self.collectives = 0  # run by this rank, and the seconds it spent in them (waits
        self.collective_s = 0.0  # for the slower ranks included): bench/tensor_parallel.py
        # Loopback only: the ranks share a node, and gloo's and NCCL's sockets stay on it.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        settings = group_settings(device, collective_timeout_s)
        for name, value in settings.env:
            os.environ.setdefault(name, value)
        dist.init_process_group(
            settings.backend,
            init_method=f"file://{store}",
            rank=shard.rank,
            world_size=shard.size,
            timeout=settings.timeout,
        )
        self.control = None
        if settings.control_timeout is not None:
            self.control = dist.new_group(backend="gloo", timeout=settings.control_timeout)
        self.shared = None
        # The segment lives in /dev/shm only between two barriers: made, mapped, unlinked.
        segment = SHM / Path(store).parent.name
        try:
            if shard.rank == 0 and SHM.is_dir() and not SharedExchange.create(segment, shard.size):
                log.warning("no room in %s for the ranks' shared memory: gloo carries all", SHM)
            dist.barrier(self.control)  # rank 0 has made it, or found no room
            if segment.exists():
                self.shared = SharedExchange(segment, shard.rank, shard.size, collective_timeout_s)
            dist.barrier(self.control)  # every rank has mapped it
        except BaseException:
            dist.destroy_process_group()  # so that another engine here can join anew
            raise
        finally:
            if shard.rank == 0:
                segment.unlink(missing_ok=True)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self._shares(x):
            assert self.shared is not None
            self._run(self.shared.all_reduce, x)
        else:
            self._run(dist.all_reduce, x)
        return x

    def fewest(self, n: int) -> int:
        """The smallest of every rank's n (KV pages: each rank's cache holds that many)."""
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_vocab(self, part: torch.Tensor) -> torch.Tensor:
        """Rank 0: the logits [rows, vocab] from each rank's vocabulary slice [rows, its
        width]; the other ranks send theirs and get their own back (they sample nothing)."""
        widths = self.shard.vocab_widths
        wide = max(widths)
        if part.shape[1] < wide:
            part = torch.nn.functional.pad(part, (0, wide - part.shape[1]))
        part = part.contiguous()
        if self._shares(part):
            assert self.shared is not None
            parts = self._run(self.shared.exchange, part)
        else:
            parts = [torch.empty_like(part) for _ in widths]
            self._run(dist.all_gather, parts, part)
        if self.shard.rank != 0:
            return part
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def send_step(self, ids: torch.Tensor, batch: StepBatch, rows: torch.Tensor) -> None:
        """Rank 0: the step every other rank runs with it."""
        table = batch.page_table
        header = [STEP, len(ids), batch.num_seqs, table.shape[1], len(rows), batch.num_decodes]
        body = [
            ids.cpu(),
            batch.positions.cpu(),
            batch.slot_mapping.cpu(),
            torch.tensor(batch.query_start + batch.context_lens, dtype=torch.long),
            table.reshape(-1).cpu(),
            rows.cpu(),
        ]
        self._broadcast(torch.tensor(header, dtype=torch.long))
        self._broadcast(torch.cat(body))

    def stop(self) -> None:
        """Rank 0: no more steps; the other ranks leave `receive_step`'s loop."""
        self._broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.long))

    def receive_step(self) -> tuple[torch.Tensor, StepBatch, torch.Tensor] | None:
        """Ranks > 0: the next step's (token ids, layout, logits rows); None at the stop."""
        header = self._broadcast(torch.empty(HEADER, dtype=torch.long), idle=True)
        op, tokens, seqs, width, nrows, decodes = header.tolist()
        if op == STOP:
            return None
        sizes = [tokens, tokens, tokens, 2 * seqs + 1, seqs * width, nrows]
        body = self._broadcast(torch.empty(sum(sizes), dtype=torch.long))
        ids, positions, slots, lens, table, rows = body.split(sizes)
        lists = lens.tolist()  # query starts, then context lengths
        starts, contexts = lists[: seqs + 1], lists[seqs + 1 :]
        batch = StepBatch(decodes, starts, contexts, table.view(seqs, width), slots, positions)
        return ids, batch, rows

    def _shares(self, t: torch.Tensor) -> bool:
        return self.shared is not None and t.device.type == "cpu" and self.shared.fits(t)

    def _broadcast(self, t: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's `t` (its shape known to all); `idle`: a wait for the next step, as
        long as rank 0 lives."""
        if self._shares(t):
            assert self.shared is not None
            return self._run(self.shared.exchange, t, patient=idle)[0].clone()
        self._run(dist.broadcast, t, src=0, group=self.control)
        return t

    def _run(self, collective: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            out = collective(*args, **kwargs)
        except (RuntimeError, PeerLost) as e:  # gloo's, NCCL's and ours, a lost peer's
            raise GroupLost(f"rank {self.shard.rank} of {self.shard.size}: {e}") from e
        self.collectives += 1
        self.collective_s += time.perf_counter() - started
        return out


class StoreDir:
    """Where a worker's ranks meet: a fresh directory on their node, removed at close."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="splitserve-tp-"))
        self.store = str(self.path / "store")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass(frozen=True)
class Rank:
    """Which rank an engine is of how many, and the file where they meet."""

    rank: int
    size: int
    store: str


class Follower(Protocol):
    """An engine of rank > 0 (LLMEngine, built with its `rank`)."""

    cache: KVCache

    @property
    def kv_heads(self) -> range: ...

    def follow(self) -> None: ...


Build = Callable[..., Follower]  # called as build(config, rank=rank)


class TensorRank:
    """A rank > 0 of a worker's model, as a Ray actor: its engine follows rank 0's steps."""

    def __init__(self, build: Build, config: EngineConfig, rank: Rank) -> None:
        self.engine = build(config, rank=rank)
        self.kv: RankEndpoint | None = None
        self.following = True

    def follow(self) -> None:
        try:
            self.engine.follow()
        finally:
            self.following = False

    def open_kv(self, name: str, compat: bytes, devices: str, transports: str) -> RankPages:
        """Open this rank's KV transfer endpoint `name` over its cache (peers write its heads
        into it, and it writes them into peers'): where its pages lie."""
        from cluster.transfer.rank_endpoint import RankEndpoint

        cache, heads = self.engine.cache, self.engine.kv_heads
        self.kv = RankEndpoint(name, cache, heads, compat, devices, transports)
        return self.kv.pages

    def progress_kv(self) -> None:
        """Keep UCX moving for this rank's endpoint while the rank follows."""
        assert self.kv is not None, "open_kv first"
        self.kv.progress(lambda: self.following)

    def write_kv(
        self, handshake: bytes, layers: range, src: list[PageId], dst: list[PageId]
    ) -> str:
        """WRITE this rank's heads of pages `src` into the peer's `dst` for `layers`; ""
        once every part has landed, else why not."""
        assert self.kv is not None, "open_kv first"
        return self.kv.write(handshake, layers, src, dst)


def driver_bundles(size: int, node: str) -> list[dict[str, float]]:
    """The placement group an engine of the driver's own reserves on CUDA: a GPU for every
    rank, rank 0's (the driver's) included, all on the driver's node (Ray's `node:<ip>`
    resource), so that no two ranks share a device."""
    return [{"GPU": 1, f"node:{node}": 0.001}] + [{"GPU": 1} for _ in range(size - 1)]


def torch_index(ray_gpu_id: str, visible: str | None) -> int:
    """The index torch gives the GPU Ray calls `ray_gpu_id`, in a process whose
    CUDA_VISIBLE_DEVICES is `visible` (Ray's ids are those of the node's visible list)."""
    if not visible:
        return int(ray_gpu_id)
    return [d.strip() for d in visible.split(",")].index(str(ray_gpu_id))


def _gpu_id() -> str:
    """The GPU Ray gave the task that runs this (in bundle 0: the driver's rank's)."""
    import ray

    return str(ray.get_gpu_ids()[0])


class Ranks:
    """Rank 0's hold on the other ranks: their actors, where they met, their follow loops."""

    def __init__(self, config: EngineConfig, build: Build, device: torch.device) -> None:
        """Start ranks 1.. (each an engine `build` makes, on rank 0's resolved `device`) on
        this node: in bundles 1.. of the placement group this engine runs in (the pool's
        STRICT_PACK group of one bundle per rank), or, outside one (an engine of the
        driver's own), on a CPU each, or on CUDA in a group of its own that reserves a GPU
        for every rank: rank 0 takes bundle 0's (`device_index`)."""
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if not ray.is_initialized():
            ray.init()
        size = config.tensor_parallel_size
        group = get_current_placement_group()
        if group is None and device.type == "cpu":
            # A rank Ray cannot place would leave rank 0 waiting for it forever: wait a while
            # for CPUs (an engine just closed frees its ranks' a moment later), then refuse.
            deadline = time.monotonic() + RANK_CPUS_WAIT_S
            while (free := ray.available_resources().get("CPU", 0)) < size - 1:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"tensor_parallel_size: {size} ranks need a CPU of Ray's each for "
                        f"ranks 1-{size - 1}; Ray has {free:g} free"
                    )
                time.sleep(0.1)
        config = dataclasses.replace(config, device=device.type)  # auto resolved: as rank 0
        self.dir = StoreDir()
        self.rank0 = Rank(0, size, self.dir.store)
        self.reserved: Any = None  # the driver's own placement group, on CUDA
        self.device_index: int | None = None  # rank 0's GPU in it
        if group is None and device.type == "cuda":
            group = self.reserved = self._reserve(size)
        actor: Any = ray.remote(TensorRank)
        self.actors = []
        for r in range(1, size):
            if group is not None:
                assert len(group.bundle_specs) == size, group.bundle_specs
                bundle = group.bundle_specs[r]
                options: dict[str, Any] = {
                    "num_cpus": bundle.get("CPU", 0),
                    "num_gpus": bundle.get("GPU", 0),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(group, r),
                }
            else:  # the driver's own engine on a CPU
                node = ray.get_runtime_context().get_node_id()
                options = {
                    "num_cpus": 1,
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
                }
            rank = Rank(r, size, self.dir.store)
            # `follow` holds a thread for the rank's life, `progress_kv` another; `write_kv`
            # (a prefill worker's) and probes get the third.
            options["max_concurrency"] = 3
            self.actors.append(actor.options(**options).remote(build, config, rank))
        self._following: list[Any] = []

    def _reserve(self, size: int) -> Any:
        """A GPU for every rank on this node; rank 0's, bundle 0's, found by a task run
        there and made this process's current device."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = driver_bundles(size, ray.util.get_node_ip_address())
        group = placement_group(bundles, strategy="STRICT_PACK")
        if not group.wait(timeout_seconds=60):
            ray.util.remove_placement_group(group)
            raise ConfigError(
                f"tensor_parallel_size: {size} ranks need {size} GPUs of this node; Ray has "
                f"not got them free ({ray.available_resources().get('GPU', 0):g} available)"
            )
        at = PlacementGroupSchedulingStrategy(group, 0)
        gpu = ray.get(ray.remote(_gpu_id).options(num_gpus=1, scheduling_strategy=at).remote())
        self.device_index = torch_index(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(self.device_index)
        return group

    def follow(self) -> None:
        """Every rank has joined and built its cache: set them following rank 0's steps."""
        self.dir.remove()  # the group is connected: the file it met through is done
        self._following = [a.follow.remote() for a in self.actors]

    def close(self, timeout_s: float = 30.0) -> None:
        """After rank 0's stop: wait for the ranks' loops to end, then end their actors."""
        import ray

        try:
            ray.get(self._following, timeout=timeout_s)
        except Exception as e:  # a rank that died, or did not stop: ended below anyway
            log.warning("a rank did not stop cleanly: %s", e)
        finally:
            for a in self.actors:
                ray.kill(a)
            if self.reserved is not None:
                ray.util.remove_placement_group(self.reserved)
            self.dir.remove()


def join(
    config: EngineConfig,
    spec: ModelSpec,
    quantization: str,
    device: torch.device,
    rank: Rank | None,
    build: Build,
) -> tuple[TensorGroup, Ranks | None]:
    """This engine's rank joined to its group, and with no `rank` given (rank 0) the other
    ranks it started. The split is checked first: a model that does not split that many
    ways is refused (ConfigError) before any rank starts."""
    size = config.tensor_parallel_size
    shard = Shard.of(spec, 0 if rank is None else rank.rank, size, quantization != "none")
    ranks = None
    if rank is None:
        ranks = Ranks(config, build, device)
        rank = ranks.rank0
    return TensorGroup(shard, rank.store, device, config.collective_timeout_s), ranks

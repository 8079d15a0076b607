"""The GPU path: saves from and loads to CUDA tensors, stream safety, NCCL.

The tests marked ``cuda`` need a CUDA device and are skipped without one (run them on
the GPU machine: ``pytest tests/torch/test_cuda.py``). The others check, on any
machine, the device-aware parts that do not need one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ucpformat  # noqa: E402
from ucpformat.torch.async_save import AsyncSaver  # noqa: E402
from ucpformat.torch.comm import collective_device  # noqa: E402
from ucpformat.torch.reads import DeviceStaging  # noqa: E402
from ucpformat.torch.staging import HostBufferPool, Staging  # noqa: E402
from ucpformat.torch.state import load, load_state_dict, save  # noqa: E402

pytestmark = pytest.mark.torch
CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())


# -- without a device ------------------------------------------------------------------------


def test_collective_device_follows_the_backend() -> None:
    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("nccl", cuda_available=True, current_device=3) == \
        torch.device("cuda", 3)
    # a group with a CPU backend keeps the bytes in host memory, where they are
    assert collective_device("cpu:gloo,cuda:nccl", cuda_available=True,
                             current_device=0) == torch.device("cpu")
    assert collective_device("cuda:nccl", cuda_available=True, current_device=1) == \
        torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="NCCL"):
        collective_device("nccl", cuda_available=False)


def test_pools_pin_only_where_cuda_is() -> None:
    assert HostBufferPool(1 << 20).pin is CUDA
    assert HostBufferPool(1 << 20).stats.pinned is CUDA


# -- on a device -----------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def _every_dtype(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    out: dict[str, torch.Tensor] = {}
    for dt in DTYPES:
        size = torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(0, 256, (33 * 17 * size,), dtype=torch.uint8, generator=gen)
        t = (raw[: 33 * 17] & 1).bool() if dt == torch.bool else raw.view(dt)
        out[str(dt).removeprefix("torch.")] = t.reshape(33, 17).to(device)
    out["transposed"] = torch.arange(12.0).reshape(3, 4).to(device).t()
    return out


@cuda
def test_every_dtype_round_trips_from_and_to_cuda(tmp_path: Path) -> None:
    tensors = _every_dtype("cuda")
    pool = HostBufferPool(64 << 10)  # smaller than the state: bounded and reused
    save(tmp_path / "ckpt", extra={"all": tensors}, staging=Staging(pool=pool))
    assert pool.stats.pinned and pool.stats.allocations > 0
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    got = load_state_dict(tmp_path / "ckpt", prefix="training/all", map_location="cuda")
    for k, v in tensors.items():
        assert got[k].device.type == "cuda" and got[k].dtype == v.dtype, k
        assert _raw(got[k]) == _raw(v.contiguous()), k


@cuda
def test_model_and_optimizer_on_cuda_save_and_load_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    save(tmp_path / "ckpt", model=model, optimizer=opt, step=1,
         staging=Staging(pool=HostBufferPool(300 << 10)))
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    fopt = torch.optim.AdamW(fresh.parameters())
    load(tmp_path / "ckpt", model=fresh, optimizer=fopt)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                         strict=True):
        assert b.device.type == "cuda" and _raw(a) == _raw(b), k
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert _raw(opt.state[p]["exp_avg"]) == _raw(fopt.state[q]["exp_avg"])


@cuda
def test_loads_to_cuda_go_through_a_bounded_pinned_pool(tmp_path: Path) -> None:
    from ucpformat.torch.reads import TensorRead, read_tensors

    tensors = {f"t{i}": torch.randn(256, 256) for i in range(8)}
    save(tmp_path / "ckpt", extra={"all": tensors})
    ck = ucpformat.open_checkpoint(tmp_path / "ckpt")
    pool = HostBufferPool(600 << 10)  # two tensors at a time
    got = read_tensors(ck, [TensorRead(f"training/all/t{i}", device="cuda") for i in range(8)],
                       staging=DeviceStaging(pool=pool)).tensors
    for i, t in enumerate(got):
        assert t.device.type == "cuda" and _raw(t) == _raw(tensors[f"t{i}"])
    assert pool.stats.pinned and pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.reuses > 0 and pool.stats.in_use_bytes == 0


@cuda
def test_parameters_modified_right_after_save_async_returns_do_not_change_it(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2048, 2048, bias=False).cuda()
    with torch.no_grad():
        torch.cuda._sleep(200_000_000)  # the stream is busy: the next kernel waits
        model.weight.fill_(1.0)  # queued, not yet run when save is called
    with AsyncSaver() as saver:
        future = saver.save(tmp_path / "ckpt", model=model)
        with torch.no_grad():
            model.weight.fill_(2.0)  # training goes on at once on the same stream
        future.result()
    stored = ucpformat.open_checkpoint(tmp_path / "ckpt").tensor("model", "weight").read()
    assert (stored == 1.0).all()  # the queued update is in, the later one is not
    assert (model.weight == 2.0).all()


@cuda
def test_async_save_under_device_memory_pressure_allocates_nothing_on_the_device(
    tmp_path: Path,
) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(max(0, free - (64 << 20)), dtype=torch.uint8, device="cuda")
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with AsyncSaver() as saver:
            saver.save(tmp_path / "a", model=model).result()
            saver.save(tmp_path / "b", model=model).result()  # the pinned buffers reused
            assert saver.staging_pool.stats.pinned and saver.staging_pool.stats.reuses > 0
        assert torch.cuda.max_memory_allocated() == before
    finally:
        # given back to the device, not kept by the caching allocator: NCCL allocates
        # outside it (the FSDP2 test after this one failed to start on an H200)
        del ballast
        torch.cuda.empty_cache()
    got = load_state_dict(tmp_path / "b")
    assert all(_raw(got[k]) == _raw(v) for k, v in model.state_dict().items())


@cuda
def test_dcp_plugin_saves_cuda_tensors_through_the_pool(tmp_path: Path) -> None:
    from ucpformat.torch.dcp import UCPWriter

    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4)).cuda()
    pool = HostBufferPool(100 << 10)
    dcp.save({"model": model.state_dict()},
             storage_writer=UCPWriter(tmp_path / "ckpt", staging=Staging(pool=pool)))
    assert pool.stats.allocations > 0 and pool.stats.in_use_bytes == 0
    got = load_state_dict(tmp_path / "ckpt")
    assert all(_raw(got[k]) == _raw(v) for k, v in model.state_dict().items())


@pytest.fixture
def nccl_group() -> Any:
    if not CUDA or not dist.is_nccl_available():
        pytest.skip("needs a CUDA device and NCCL")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@cuda
def test_fsdp2_on_cuda_saves_and_loads_over_nccl(tmp_path: Path, nccl_group: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    from ucpformat.torch.comm import TorchCommunicator
    from ucpformat.torch.distributed import load_distributed, save_distributed

    assert TorchCommunicator().device.type == "cuda"  # NCCL: the collectives on the GPU

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).cuda()
        for layer in m:
            fully_shard(layer)
        return fully_shard(m)

    model = build()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    save_distributed(tmp_path / "ckpt", model=model, optimizer=opt, step=3)
    fresh = build()
    fopt = torch.optim.AdamW(fresh.parameters())
    load_distributed(tmp_path / "ckpt", model=fresh, optimizer=fopt)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                         strict=True):
        assert _raw(a.full_tensor()) == _raw(b.full_tensor()), k


@cuda
def test_staged_loads_into_cuda_targets_go_through_the_pinned_pool(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)).cuda()
    save(tmp_path / "ckpt", model=model)
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)).cuda()
    pool = DeviceStaging().the_pool()  # the shared pool loads use by default
    used = pool.stats.allocations + pool.stats.reuses
    load(tmp_path / "ckpt", model=fresh)  # staged: copied to the device at apply
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                         strict=True):
        assert b.device.type == "cuda" and _raw(a) == _raw(b), k
    assert pool.stats.pinned and pool.stats.allocations + pool.stats.reuses >= used + 4
    assert pool.stats.in_use_bytes == 0


@cuda
def test_deepspeed_engine_fragments_on_cuda_stage_through_pinned_buffers(
        tmp_path: Path) -> None:
    """What ucpformat.deepspeed.save hands the pipeline, on CUDA: a flat ZeRO partition,
    a strided box of a weight and a scalar, synchronously through a bounded pinned pool
    and as an async snapshot (events; the stream guarded, then the tensors changed)."""
    from ucpformat.deepspeed.save import EngineFragments
    from ucpformat.distributed.comm import SingleProcess
    from ucpformat.distributed.pipeline import save as run_pipeline
    from ucpformat.distributed.save_plan import TensorSpec
    from ucpformat.torch.staging import DeviceCopier, Snapshot

    torch.manual_seed(0)
    flat = torch.randn(2 * 256 * 256, device="cuda")
    wide = torch.randn(256, 512, device="cuda")
    step = torch.tensor(3, dtype=torch.int64, device="cuda")
    full = ((0, 256), (0, 256))
    specs = [TensorSpec(p, (256, 256), "float32", {"ucp": {"role": "parameter"}})
             for p in ("a", "b", "left")]
    specs.append(TensorSpec("step", (), "int64", {"ucp": {"role": "optimizer_state"}}))
    expected = {"a": _raw(flat[:65536]), "b": _raw(flat[65536:]),
                "left": _raw(wide[:, :256]), "step": _raw(step)}

    def fragments(staging: Staging) -> EngineFragments:
        src = EngineFragments(staging)
        src.add("a", full, flat[:65536])
        src.add("b", full, flat[65536:])
        src.add("left", full, wide[:, :256])
        src.add("step", (), step)
        return src

    pool = HostBufferPool(600 << 10)  # two of the three 256 KiB fragments at a time
    src = fragments(Staging(pool=pool))
    try:
        run_pipeline(tmp_path / "sync", SingleProcess(), specs=specs, source=src)
    finally:
        src.stop()
    assert pool.stats.pinned and pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.in_use_bytes == 0
    copier = DeviceCopier()
    snap = Snapshot(HostBufferPool(None), copier)
    src = fragments(Staging())
    copier.begin(src.tensors())
    frags = src.snapshot(snap)
    snap.guard()  # as the save does before it returns: training's stream waits
    for tensor in (flat, wide, step):
        tensor.add_(1)  # queued on the guarded stream: after the copies
    snap.wait()
    run_pipeline(tmp_path / "async", SingleProcess(), specs=specs, source=frags)
    snap.release()
    for where in ("sync", "async"):
        with ucpformat.open_checkpoint(tmp_path / where) as ck:
            for name, raw in expected.items():
                assert ck[name].read().tobytes() == raw, (where, name)

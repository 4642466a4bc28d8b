"""KVQuant and KIVI decode steps through a CUDA graph's static write plan
(`graph_write_plan` / `fill_graph_write` of the stores, `nanokv/quant/graph_write.py`; the Triton
backend's `graph_decode_metadata` / `fill_graph_decode`): the padded plan writes the same bytes as
the PyTorch path's ordinary plan (padded rows hold garbage and write nothing), and the engine
through the static buffers (`DecodeGraphs(capture=False)`) gives the eager engine's tokens and
cache bytes. tests/cuda/test_cuda_graphs.py captures real
graphs on a GPU.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

import dataclasses
import random

import pytest
import torch

from triton_device import triton_device

DEVICE = triton_device()  # the module skips without a GPU or the interpreter

from kvquant_write_cases import HKV, activations, assert_same_bytes, config_for  # noqa: E402

from nanokv.cache.kv_pool import KVLayout  # noqa: E402
from nanokv.quant import KVQuantStore  # noqa: E402
from nanokv.quant.kivi_store import KIVIStore  # noqa: E402


pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
BLOCK = 8


def _store(config, head_dim, triton_write, num_blocks=24, dtype=torch.float32):
    layout = KVLayout(2, HKV, head_dim, BLOCK, dtype)
    store = KVQuantStore(layout, num_blocks, config, num_staging_blocks=6, device=DEVICE)
    store.triton_write, store.native_write = triton_write, False
    return store


def decode_steps(seed: int, num_steps: int):
    """Random decode steps of up to 5 requests (each its own 4 blocks), one token a request:
    (blocks released before the step, slots, positions). Requests start at position 0 (sink
    tokens), leave (their blocks released) and come back; blocks fill mid-run."""
    rng = random.Random(seed)
    position = {}
    steps = []
    for _ in range(num_steps):
        released = []
        for r in range(5):
            if r not in position and rng.random() < 0.5:
                position[r] = 0
            elif r in position and (position[r] >= 4 * BLOCK or rng.random() < 0.05):
                del position[r]
                released += range(4 * r, 4 * r + 4)
        rows = [r for r in sorted(position) if rng.random() < 0.9]
        slots = [r * 4 * BLOCK + position[r] for r in rows]
        steps.append((released, slots, [position[r] for r in rows]))
        for r in rows:
            position[r] += 1
    return steps


def write_decode_steps(graph_store, reference, head_dim, seed, max_batch=8):
    """`decode_steps(seed, 70)` written to both stores: the reference through its ordinary
    plan, graph_store through its graph plan padded to a random bucket at or above the step's
    rows, the padded rows' keys and values garbage. Returns (blocks filled, sink tokens)."""
    graph = graph_store.graph_write_plan(max_batch)
    filled = sinks = 0
    for i, (released, slots, positions) in enumerate(decode_steps(seed, 70)):
        for store in (graph_store, reference):
            store.release(released)
        n = len(slots)
        if not n:
            continue
        batch = random.Random(i).randint(n, max_batch)
        k = activations(n, head_dim, 2 * i).to(DEVICE)
        v = activations(n, head_dim, 2 * i + 1).to(DEVICE)
        garbage = torch.full((batch - n, HKV, head_dim), 1e4, device=DEVICE)  # never written
        plan = reference.begin_step(slots, positions)
        static = graph_store.fill_graph_write(graph, graph_store.begin_step(slots, positions),
                                              batch)
        assert static.slot_mapping.shape == (batch,) and static.quant_src.shape == (batch, BLOCK)
        filled += plan.quant_blocks.numel()
        sinks += getattr(plan, "sink_src", torch.empty(0)).numel()
        for layer in range(2):
            kl, vl = k * (layer + 1), v - layer
            reference.write(layer, plan, kl, vl)
            graph_store.write(layer, static, torch.cat([kl, garbage]), torch.cat([vl, -garbage]))
    return filled, sinks


@pytest.mark.parametrize("name", ["4bit", "2bit-nuq-thresholds", "4bit-bf16-sparse-wide"])
def test_graph_plan_writes_what_the_ordinary_plan_writes(name):
    config, head_dim = config_for(name)
    graph_store = _store(config, head_dim, triton_write=True)
    reference = _store(config, head_dim, triton_write=False)  # the PyTorch path
    filled, sinks = write_decode_steps(graph_store, reference, head_dim, len(name))
    assert filled >= 8 and sinks >= 4  # the steps filled blocks and wrote sink tokens
    assert assert_same_bytes(graph_store, reference) >= 10


@pytest.mark.parametrize("bits,head_dim", [(2, 32), (4, 48)])
def test_kivi_graph_plan_writes_what_the_ordinary_plan_writes(bits, head_dim):
    layout = KVLayout(2, HKV, head_dim, BLOCK, torch.float32)
    graph_store, reference = (KIVIStore.from_settings(layout, 24, DEVICE, bits=bits,
                                                      num_staging_blocks=6) for _ in range(2))
    graph_store.triton_write, reference.triton_write = True, False
    filled, _ = write_decode_steps(graph_store, reference, head_dim, bits)
    assert filled >= 8
    assert assert_same_bytes(graph_store, reference) == 9
    with pytest.raises(ValueError, match="between the step's 0 tokens and max_batch 8"):
        graph_store.fill_graph_write(graph_store.graph_write_plan(8), None, 9)
    with pytest.raises(RuntimeError, match="Triton write"):
        reference.graph_write_plan(4)


def test_empty_fill_pads_every_row():
    """What a graph is captured with (no rows): every entry padded, nothing written."""
    config, head_dim = config_for("4bit")
    store = _store(config, head_dim, triton_write=True)
    before = {name: buf.clone() for name, buf in store.buffers.items()}
    graph = store.graph_write_plan(4)
    plan = store.fill_graph_write(graph, None, 4)
    for part in (plan.slot_mapping, plan.stage_dst, plan.quant_blocks, plan.sink_dst):
        assert part.tolist() == [-1] * 4
    assert not plan.token_valid.any() and not plan.quant_valid.any()
    x = torch.randn(4, HKV, head_dim, device=DEVICE)
    store.write(0, plan, x, x)
    for name, buf in store.buffers.items():
        assert torch.equal(buf, before[name]), name


def test_graph_plan_refusals():
    config, head_dim = config_for("4bit")
    with pytest.raises(RuntimeError, match="Triton write"):
        _store(config, head_dim, triton_write=False).graph_write_plan(4)
    store = _store(config, head_dim, triton_write=True)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        store.graph_write_plan(0)
    graph = store.graph_write_plan(4)
    plan = store.begin_step([0, 40, 80], [0, 0, 0])
    with pytest.raises(ValueError, match="between the step's 3 tokens and max_batch 4"):
        store.fill_graph_write(graph, plan, 2)
    with pytest.raises(ValueError, match="between the step's 3 tokens and max_batch 4"):
        store.fill_graph_write(graph, plan, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_rows_rounds_as_pytorch(dtype):
    """Rows cast as `.to(dtype)` casts them (to nearest even), fp16's overflow included."""
    from nanokv.kernels.triton import kvquant_write

    x = activations(40, 16, seed=5).to(DEVICE) * 3  # [40, HKV, 16] float32
    out = torch.zeros(40, HKV, 16, dtype=dtype, device=DEVICE)
    idx = torch.arange(40, device=DEVICE)
    kvquant_write.scatter_rows(x, idx, idx.flip(0), out)
    assert torch.equal(out.view(torch.uint8), x.flip(0).to(dtype).view(torch.uint8))


def test_scatter_rows_skips_padding_and_refuses_bad_shapes():
    from nanokv.kernels.triton import kvquant_write

    x = torch.randn(3, HKV, 16, device=DEVICE)
    out = torch.zeros(8, HKV, 16, device=DEVICE)
    idx = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        kvquant_write.scatter_rows(x, idx, idx, torch.zeros(8, HKV + 1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="src and dst must be"):
        kvquant_write.scatter_rows(x, idx, idx[:2], out)
    kvquant_write.scatter_rows(x, idx, torch.tensor([5, -1, 0], device=DEVICE), out)
    assert torch.equal(out[5], x[0]) and torch.equal(out[0], x[2])
    assert not out[[1, 2, 3, 4, 6, 7]].any()  # -1: skipped


@pytest.mark.parametrize("kv", [dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
                                dict(kv_cache_dtype="kivi", kv_quant_bits=2)])
def test_engine_through_static_buffers_equals_eager(tiny_llama, monkeypatch, kv):
    """The Triton backend's graph contract over a kvquant or kivi store, through the engine:
    decode steps of 1-3 requests (3 padded to the bucket of 4) (blocks fill, kvquant's sink
    tokens written) give the eager engine's tokens and leave the same cache bytes."""
    from nanokv import LLM, SamplingParams
    from nanokv.attention.triton_quantized import TritonQuantizedBackend
    from nanokv.utils import cdiv
    from nanokv.worker.cuda_graph import DecodeGraphs

    prompts = [[5], list(range(3, 14)), list(range(7, 40))]  # the first decodes its sinks
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 9, 5)]
    settings = KVQuantStore.settings_from_options

    def three_sinks(options, layout):  # the engine's config, with 3 sink tokens and 5% outliers
        found = settings(options, layout)
        found["config"] = dataclasses.replace(found["config"], num_sink_tokens=3,
                                              outlier_fraction=0.05)
        return found

    monkeypatch.setattr(KVQuantStore, "settings_from_options", staticmethod(three_sinks))
    engines = {}
    for mode in ("eager", "static"):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=16, num_kv_blocks=12,
                  max_num_seqs=4, max_model_len=64, attention_backend="triton",
                  device=DEVICE.type, enforce_eager=True, **kv)
        runner = llm.engine.runner
        assert type(runner.backend) is TritonQuantizedBackend
        store = llm.engine.kv_cache
        # the Triton write by default on CUDA; the C write on CPU
        assert runner.backend.supports_cuda_graphs == (DEVICE.type == "cuda")
        assert getattr(store, "num_sinks", 3) == 3
        store.triton_write = True  # as on CUDA
        assert runner.backend.supports_cuda_graphs
        if mode == "static":
            runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.device, 4,
                                         cdiv(64, 16), capture=False)
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engines[mode] = (llm, tokens)
    (eager, want), (static, got) = engines["eager"], engines["static"]
    assert got == want
    graphs = static.engine.runner.graphs
    assert graphs.num_graph_steps >= 10 and graphs.padded_rows > 0
    assert assert_same_bytes(static.engine.kv_cache, eager.engine.kv_cache) >= 9

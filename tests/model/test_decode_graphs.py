"""The decode-graph runner's logic on CPU (also where there is a GPU: tests/cuda captures
graphs there): bucket choice, padding, static buffers filled in place,
replay-or-eager decisions, run eagerly (`capture=False`) over a small backend that implements the
graph contract on the PyTorch reference. Its tokens are checked against Hugging Face greedy
decoding and against the ordinary (eager) step, with batch sizes between buckets and under
preemption."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.torch_paged import TorchPagedBackend
from nanokv.cache.kv_pool import write_slots
from nanokv.layers.attention import dense_reference_attention
from nanokv.scheduler.output import ScheduledRequest, SchedulerOutput
from nanokv.utils import cdiv
from nanokv.worker.cuda_graph import DecodeGraphs, graph_batch_sizes
from tiny_models import VOCAB, hf_greedy, load_hf

BLOCK, MAX_LEN = 16, 128
CPU = dict(device="cpu")  # the engine's default device is CUDA where there is one


@dataclass
class StaticDecode:
    slot_mapping: torch.Tensor  # [max_batch] int64, -1 on padded rows
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    context_lens: torch.Tensor  # [max_batch] int32, 0 on padded rows
    num_rows: int = 0


class ReferenceGraphBackend(TorchPagedBackend):
    """The graph contract over the PyTorch reference: static metadata filled in place; each row
    attends densely over its own context (padded rows: nothing written, zeros out)."""

    supports_cuda_graphs = True

    def graph_decode_metadata(self, max_batch: int, max_blocks: int) -> StaticDecode:
        self.fills = 0
        return StaticDecode(torch.full((max_batch,), -1, dtype=torch.long),
                            torch.zeros(max_batch, max_blocks, dtype=torch.int32),
                            torch.zeros(max_batch, dtype=torch.int32))

    def fill_graph_decode(self, meta: StaticDecode, common: CommonAttentionMetadata,
                          batch: int) -> None:
        n = len(common.decode_context_lens)
        meta.slot_mapping[:n] = torch.tensor(common.slot_mapping[:n])
        meta.slot_mapping[n:batch] = -1
        meta.block_tables[:batch] = 0
        for i, table in enumerate(common.decode_block_tables):
            meta.block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        meta.context_lens[:n] = torch.tensor(common.decode_context_lens, dtype=torch.int32)
        meta.context_lens[n:batch] = 0
        meta.num_rows = batch
        self.fills += 1

    def forward(self, layer, q, k, v, k_pre, metadata, scale):
        if not isinstance(metadata, StaticDecode):
            return super().forward(layer, q, k, v, k_pre, metadata, scale)
        rows = metadata.num_rows
        if q.shape[0] != rows:
            raise AssertionError(f"{q.shape[0]} query rows for a graph batch of {rows}")
        k_cache, v_cache = self.kv_cache.layer(layer)  # [N, B, Hkv, D]
        slots = metadata.slot_mapping[:rows]
        real = slots >= 0
        write_slots(k_cache, v_cache, slots[real], k[real], v[real])
        out = torch.zeros_like(q)
        k_slots = k_cache.view(-1, *k_cache.shape[2:])  # [N * B, Hkv, D]
        v_slots = v_cache.view(-1, *v_cache.shape[2:])
        for i in range(rows):
            context = int(metadata.context_lens[i])
            if context == 0:
                continue
            table = metadata.block_tables[i, :cdiv(context, BLOCK)].long()
            idx = (table[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:context]  # [S]
            out[i] = dense_reference_attention(q[i:i + 1], k_slots[idx], v_slots[idx], scale)[0]
        return out


def with_static_graphs(llm: LLM, max_num_seqs: int) -> DecodeGraphs:
    runner = llm.engine.runner
    backend = ReferenceGraphBackend(runner.kv_cache, runner.device)
    runner.backend = backend
    runner.graphs = DecodeGraphs(runner.model, backend, runner.device, max_num_seqs,
                                 cdiv(MAX_LEN, BLOCK), capture=False)
    return runner.graphs


def prompts_and_lengths(seed: int, n: int, longest: int = 14):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB - 10) for _ in range(rng.randrange(3, 40))]
               for _ in range(n)]
    lengths = [rng.randrange(2, longest) for _ in range(n)]  # requests leave at different steps
    return prompts, lengths


@pytest.mark.parametrize("options", [dict(), dict(num_kv_blocks=8)],
                         ids=["plain", "preemption"])
def test_static_decode_equals_hf_and_eager(tiny_model, options):
    prompts, lengths = prompts_and_lengths(1 if options else 0, 5, 40 if options else 14)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    hf = load_hf(tiny_model)
    expected = [hf_greedy(hf, p, n)[0] for p, n in zip(prompts, lengths)]
    kw = dict(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=20,
              attention_backend="torch", **CPU, **options)
    eager = [o.token_ids for o in LLM(tiny_model, **kw).generate(prompts, params)]
    llm = LLM(tiny_model, **kw)
    graphs = with_static_graphs(llm, 20)
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert eager == expected
    # decode steps of 5, 4, 3 ... rows ran padded to their buckets, prefill steps eagerly
    assert graphs.num_graph_steps > 0 and graphs.padded_rows > 0
    assert llm.engine.runner.backend.fills == graphs.num_graph_steps
    if options:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()


def test_seeded_sampling_is_the_same_through_static_buffers(tiny_llama):
    prompts, _ = prompts_and_lengths(1, 6)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=100 + i, max_tokens=8,
                             ignore_eos=True) for i in range(6)]
    kw = dict(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=8,
              attention_backend="torch", **CPU)
    eager = [o.token_ids for o in LLM(tiny_llama, **kw).generate(prompts, params)]
    llm = LLM(tiny_llama, **kw)
    graphs = with_static_graphs(llm, 8)
    assert [o.token_ids for o in llm.generate(prompts, params)] == eager
    assert graphs.num_graph_steps > 0


def test_batch_sizes_and_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_eager_when_the_step_does_not_fit(tiny_llama):
    llm = LLM(tiny_llama, block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=4,
              attention_backend="torch", **CPU)
    graphs = with_static_graphs(llm, 4)
    assert [graphs.bucket(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="exceed"):
        graphs.bucket(5)
    runner = llm.engine.runner
    engine = llm.engine
    # a prefill step, then a decode-only step, then the same decode with query capture
    for p in ([5, 6, 7], [8, 9]):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    sched = engine.scheduler.schedule()
    assert not graphs.can_run(runner.inputs(sched))
    engine.runner.execute(sched)
    # not through the engine loop: decode steps built by hand from the prefill's requests
    decodes = [ScheduledRequest(s.request_id, [3], s.num_tokens, s.num_tokens, s.block_table,
                                True, s.params, 1) for s in sched.scheduled]
    assert graphs.can_run(runner.inputs(SchedulerOutput(decodes)))
    # a mixed step (decodes, then a prefill chunk) stays eager
    chunk = ScheduledRequest("p", [1, 2, 3], 0, 0, [7], True, decodes[0].params, 0)
    assert not graphs.can_run(runner.inputs(SchedulerOutput(decodes + [chunk])))
    # so do per-layer block tables and query capture
    pool = runner.num_pool_blocks
    decodes[1].layer_tables = [[layer * pool + b for b in decodes[1].block_table]
                               for layer in range(runner.kv_cache.layout.num_layers)]
    decodes[1].layer_start_slots = [decodes[1].start_slot] * runner.kv_cache.layout.num_layers
    assert not graphs.can_run(runner.inputs(SchedulerOutput(decodes)))
    decodes[1].layer_tables = decodes[1].layer_start_slots = None
    decodes[0].capture_from = 0
    assert not graphs.can_run(runner.inputs(SchedulerOutput(decodes)))
    decodes[0].capture_from = None
    # and several rows of a request: a short chunk's decode rows (as speculative drafts)
    rows = ScheduledRequest(decodes[0].request_id, [3, 4], 3, 3, decodes[0].block_table, True,
                            decodes[0].params, 1, decode_rows=True)
    assert rows.is_decode and graphs.can_run(runner.inputs(SchedulerOutput(decodes)))
    assert not graphs.can_run(runner.inputs(SchedulerOutput([rows, decodes[1]])))


def test_graphs_need_cuda_and_a_backend_that_supports_them(tiny_llama):
    llm = LLM(tiny_llama, block_size=BLOCK, max_model_len=MAX_LEN, **CPU)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: always eager
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        DecodeGraphs(runner.model, runner.backend, runner.device, 4, 8, capture=False)
    backend = ReferenceGraphBackend(runner.kv_cache, runner.device)
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(runner.model, backend, runner.device, 4, 8, capture=True)


def test_triton_backend_through_static_buffers_equals_hf(tiny_llama):
    """The Triton backend's side of the graph contract (under Triton's interpreter on CPU)."""
    triton_paged = pytest.importorskip("nanokv.attention.triton_paged")
    if not triton_paged.interpreter_on() or triton_paged.triton_unavailable():
        pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1 with triton")
    prompts, lengths = prompts_and_lengths(0, 3, 6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    hf = load_hf(tiny_llama)
    expected = [hf_greedy(hf, p, n)[0] for p, n in zip(prompts, lengths)]
    llm = LLM(tiny_llama, block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=8,
              attention_backend="triton", **CPU)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.device, 8,
                                 cdiv(MAX_LEN, BLOCK), capture=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert runner.graphs.num_graph_steps > 0 and runner.graphs.padded_rows > 0


def test_steps_with_lora_rows_run_eagerly(tiny_llama, tmp_path):
    """A decode step with LoRA adapter rows never goes through the graphs (a captured graph
    holds no adapter); base-model decode steps still do. Tokens: the eager LoRA engine's."""
    from nanokv.lora import LoRARequest
    from tiny_models import write_lora_adapter

    lora = LoRARequest("a", 1, write_lora_adapter(tiny_llama, str(tmp_path / "a")))
    prompts, _ = prompts_and_lengths(2, 4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=8,
              attention_backend="torch", enable_lora=True, **CPU)
    eager = LLM(tiny_llama, **kw)
    want = {name: [o.token_ids for o in eager.generate(prompts, params, lora_request=adapter)]
            for name, adapter in (("base", None), ("lora", lora))}
    assert want["base"] != want["lora"]
    llm = LLM(tiny_llama, **kw)
    graphs = with_static_graphs(llm, 8)
    assert [o.token_ids for o in llm.generate(prompts, params, lora_request=lora)] == \
        want["lora"]
    assert graphs.num_graph_steps == 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == want["base"]
    assert graphs.num_graph_steps > 0

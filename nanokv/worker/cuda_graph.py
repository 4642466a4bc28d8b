"""CUDA graphs for decode-only steps.

A decode step of n requests runs the graph captured for the smallest batch-size bucket >= n
(1, 2, 4, 8, then steps of 16 up to max_num_seqs, as nano-vLLM). Every graph reads the same
static buffers: input ids, positions, and the attention backend's static decode metadata
(`AttentionBackend.graph_decode_metadata`, filled in place each step by `fill_graph_decode`:
rows n..bucket are padding with slot -1 and context 0). The graphs share one memory pool and
write the model's hidden states into one static output buffer, whose first n rows the runner
reads (padded rows' outputs are never sampled). Prefill and mixed steps stay eager, as does any
step with per-layer block tables, query capture, or a table longer than the captured width;
the runner builds this object only on CUDA, with a backend that supports graphs, without tensor
parallelism, unless `enforce_eager`.

`capture=False` runs the same static-buffer path eagerly (no graph): bucket choice, padding and
filling are then testable on CPU against the ordinary step.
"""

from __future__ import annotations

import torch

from nanokv.attention.common import CommonAttentionMetadata, StepAttention
from nanokv.worker.step_inputs import StepInputs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured buckets: 1, 2, 4, 8, 16, 32, ... up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend, device: torch.device, max_num_seqs: int,
                 max_blocks: int, capture: bool = True) -> None:
        """max_blocks: the longest block table a request can have (cdiv(max_model_len, block
        size)); capture: record CUDA graphs (False: run the static buffers eagerly)."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} does not support CUDA graphs")
        self.model, self.backend, self.device = model, backend, device
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch, self.max_blocks = self.batch_sizes[-1], max_blocks
        self.capture = capture
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.meta = backend.graph_decode_metadata(self.max_batch, max_blocks)
        self.hidden: torch.Tensor | None = None  # [max_batch, hidden], the graphs' output
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_graph_steps = 0  # decode steps run through the static buffers
        self.padded_rows = 0  # their padding rows, summed
        if capture:
            self._capture_all()

    def bucket(self, num_rows: int) -> int:
        """The smallest captured batch size >= num_rows."""
        for size in self.batch_sizes:
            if size >= num_rows:
                return size
        raise ValueError(f"{num_rows} rows exceed the largest graph batch {self.max_batch}")

    def can_run(self, inputs: StepInputs) -> bool:
        """A decode-only step the static buffers can hold, with one row a request (several
        rows of a request, speculative drafts or a short chunk's decode rows, writing one block,
        run eagerly: not yet checked on a GPU through the graphs' static write plans)."""
        c = inputs.common
        return (inputs.is_decode_only and c.per_layer is None and inputs.capture_rows is None
                and not inputs.has_row_groups
                and c.num_decodes <= self.max_batch
                and max(len(t) for t in c.decode_block_tables) <= self.max_blocks)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states [n, hidden] (n = its decodes), through the graph of its
        bucket (or the same buffers eagerly)."""
        n = inputs.common.num_decodes
        batch = self.bucket(n)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.input_ids[n:batch].zero_()
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.positions[n:batch].zero_()
        self.backend.fill_graph_decode(self.meta, inputs.common, batch)
        self.num_graph_steps += 1
        self.padded_rows += batch - n
        if not self.capture:
            return self._forward(batch)[:n]
        self.graphs[batch].replay()
        return self.hidden[:n]

    def _forward(self, batch: int) -> torch.Tensor:
        step = StepAttention(self.backend, self.meta, None)
        hidden, _ = self.model(self.input_ids[:batch], self.positions[:batch], step)
        return hidden  # [batch, hidden]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per bucket, largest first, in one memory pool; every row padding (slot -1:
        nothing is written to the cache during capture)."""
        pool = torch.cuda.graph_pool_handle()
        nothing = CommonAttentionMetadata([], 0, [], [], [])
        for batch in reversed(self.batch_sizes):
            self.backend.fill_graph_decode(self.meta, nothing, batch)
            warm = self._forward(batch)  # compiles kernels, settles allocations
            if self.hidden is None:
                self.hidden = torch.zeros(self.max_batch, warm.shape[1], dtype=warm.dtype,
                                          device=self.device)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:batch].copy_(self._forward(batch))
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

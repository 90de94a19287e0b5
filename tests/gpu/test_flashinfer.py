"""The flashinfer backend on CUDA against the torch backend (marked `gpu`: skipped
without CUDA, and skipped saying so where the flashinfer package is not installed).

* kernels: one mixed step (decodes, chunks with a past, a fresh prefill) over a random
  pool with scattered pages, two layers: the torch backend's outputs (computed in
  float32 from the same rounded inputs) within 1e-3 in fp16 and 1e-2 in bf16, and the
  same pool afterwards;
* the real model (SmolLM2-135M, fp16) over a fixed schedule that mixes chunked prefill
  with batched decode: torch's greedy tokens fed to flashinfer too, the same logits
  within a tolerance and the same argmax where it is not a near-tie;
* CUDA graphs of the decode step (predd/worker/cuda_graphs.py): the same schedule with
  graphs on and off, the same tokens fed to both: every logit within a tolerance, the
  same argmax where it is not a near-tie, and the pure decode steps replayed;
* the daemon: `predd --attention flashinfer` serves (with its CUDA graphs, `auto`), says
  so in `info`, and generates the tokens `--attention torch` does.
On a machine with no package index: `bash scripts/gpu_check.sh prepare` here, then
`bash scripts/gpu_check.sh run` there (docs/kernels.md, "GPU runs", has the results).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from predd.attention.backends import TorchAttention
from predd.worker.paged_kv import PagedKVCache
from predd.attention.page_table import PageTables

pytestmark = pytest.mark.gpu

# Against the torch backend in float32 over the same (rounded) pool and inputs, so that
# only FlashInfer's rounding counts: outputs stay below 1 in magnitude (V ~ N(0, 0.25)),
# where one ulp is <= 4.9e-4 in fp16 and <= 3.9e-3 in bf16.
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
PS = 16
# (kv_len, q_len): a first token, a decode ending a page, a long decode, a chunk with a
# past across pages, a fresh prefill, a two-token chunk across a page boundary
STEP = [(1, 1), (16, 1), (37, 1), (50, 13), (20, 20), (17, 2)]


@pytest.fixture
def flashinfer():
    return pytest.importorskip("flashinfer", reason="the flashinfer package is not installed")


def random_pool(heads, kv_heads, head_dim, dtype, layers=2, pages=64):
    cfg = SimpleNamespace(name="t", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=head_dim)
    cache = PagedKVCache(cfg, pages, PS, dtype, torch.device("cuda"))
    torch.manual_seed(0)
    cache.kv.normal_(0, 0.25)
    return cache


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128)],
                         ids=["smollm2-shape", "gqa4-tensor-cores"])
def test_kernels_match_the_torch_backend(flashinfer, heads, kv_heads, head_dim, dtype):
    from predd.attention.flashinfer_backend import FlashInferAttention
    free = list(np.random.default_rng(1).permutation(64))
    pages = [np.array([free.pop() for _ in range(-(-kv // PS))]) for kv, _ in STEP]
    tables = PageTables.build(PS, pages, [kv for kv, _ in STEP], [n for _, n in STEP])
    ours = random_pool(heads, kv_heads, head_dim, dtype)
    ref = random_pool(heads, kv_heads, head_dim, torch.float32)
    ref.kv.copy_(ours.kv)
    backend = FlashInferAttention(ours)
    attend, attend_ref = backend.prepare(tables), TorchAttention(ref).prepare(tables)
    rows = int(tables.qo_indptr[-1])
    gen = torch.Generator(device="cuda").manual_seed(2)
    for layer in range(2):
        # scores q.k/sqrt(D) ~ N(0, 2^2): peaked, so a wrong mask or page moves outputs
        # by ~0.1; K and V ~ N(0, 0.25) like the pool
        q = torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 8
        k = torch.randn(rows, kv_heads, head_dim, device="cuda", generator=gen) * 0.25
        v = torch.randn(rows, kv_heads, head_dim, device="cuda", generator=gen) * 0.25
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        got = attend(layer, q, k, v)
        want = attend_ref(layer, q.float(), k.float(), v.float())
        assert got.dtype == dtype and got.shape == want.shape
        diff = (got.float() - want).abs().max().item()
        assert diff <= TOLERANCE[dtype], f"layer {layer}: max abs diff {diff}"
    assert torch.equal(ours.kv.float(), ref.kv)          # the same K/V in the same slots


# ----------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def model_path():
    """$SYMPHONY_GPU_MODEL where set (scripts/gpu_check.sh brings a GGUF cut to its
    first layers: the device transfer is size-limited), else SmolLM2-135M."""
    from predd.model.loader import default_model_path
    if os.environ.get("SYMPHONY_GPU_MODEL"):
        return os.environ["SYMPHONY_GPU_MODEL"]
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


class Greedy:
    """Drives a Runner over a fixed schedule: per sequence its tokens, its page table
    (pages handed out from a shuffled free list), the tokens it produced and the logits
    each came from. A token is the argmax, or with `forced` the one given there (the
    same tokens fed to a second backend, so that a near-tie that rounds the other way
    cannot send it down another path)."""

    def __init__(self, runner, prompts: list[list[int]],
                 forced: list[list[int]] | None = None) -> None:
        self.runner, self.ps = runner, runner.config.page_size
        self.free = list(np.random.default_rng(3).permutation(runner.config.kv_pages))
        self.done = [0] * len(prompts)              # entries computed
        self.tokens = [list(p) for p in prompts]
        self.pages: list[list[int]] = [[] for _ in prompts]
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.forced = forced

    def chunk(self, i: int, n: int):
        from predd.engine.chunk import Chunk
        start, end = self.done[i], self.done[i] + n
        while len(self.pages[i]) * self.ps < end:
            self.pages[i].append(int(self.free.pop()))
        self.done[i] = end
        return Chunk(np.array(self.tokens[i][start:end], np.int32),
                     np.arange(start, end, dtype=np.int32),
                     np.array(self.pages[i], np.int32), end, np.array([n - 1]))

    def step(self, work: list[tuple[int, int | None]]) -> None:
        """One forward pass: (sequence, n) computes its next n entries (None: all that
        are pending); a sequence whose entries are all computed takes its next token."""
        chunks = [self.chunk(i, len(self.tokens[i]) - self.done[i] if n is None else n)
                  for i, n in work]
        for (i, _), logits in zip(work, self.runner.execute(chunks)):
            if self.done[i] == len(self.tokens[i]):
                token = (self.forced[i][len(self.generated[i])] if self.forced
                         else int(logits[0].argmax()))
                self.tokens[i].append(token)
                self.generated[i].append(token)
                self.logits[i].append(logits[0].float())


def run_schedule(runner, prompts: list[list[int]], new: int,
                 forced: list[list[int]] | None = None) -> Greedy:
    g = Greedy(runner, prompts, forced)
    g.step([(0, 3)])                          # A: a first chunk
    g.step([(0, None), (1, None)])            # A's rest (with a past), B fresh
    for t in range(new):
        work = [(0, None), (1, None)]
        if t == 3:
            work.append((2, 5))               # C's first chunk among decodes
        elif t > 3:
            work.append((2, None))            # C's rest, then C decodes too
        g.step(work)
    return g


# fp16 logits of SmolLM2 (|logit| up to ~30, ulp 1/64 there) through its layers in two
# kernels' summation orders; a wrong mask, page or position moves them by whole units
LOGIT_TOLERANCE = 0.25


def test_real_model_greedy_tokens_match(flashinfer, model_path):
    """torch's greedy run, then flashinfer fed the same tokens: every logit of every
    step within LOGIT_TOLERANCE, and the same argmax wherever torch's top two are
    further apart than twice that (a closer pair is a tie either may break)."""
    from predd.worker.runner import Runner, RunnerConfig
    prompts = prompts_of(model_path)
    runs = {}
    for name in ("torch", "flashinfer"):
        runner = Runner(RunnerConfig(model_path, device="cuda", dtype="float16",
                                     kv_pages=64, page_size=PS, attention=name,
                                     cuda_graphs="off"))
        assert runner.backend.name == name and runner.graphs is None
        runs[name] = run_schedule(runner, prompts, 24,
                                  runs["torch"].generated if runs else None)
        del runner
        torch.cuda.empty_cache()
    assert_same_logits(runs["torch"], runs["flashinfer"])


def prompts_of(model_path) -> list[list[int]]:
    from predd.model.tokenizer import load_tokenizer
    tok = load_tokenizer(model_path)
    return [tok.encode(text) for text in (
        "The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "A paged KV cache stores attention keys and values in fixed-size pages, so that")]


def assert_same_logits(ref: Greedy, got: Greedy) -> None:
    """Every logit of every step within LOGIT_TOLERANCE, and the same argmax wherever
    ref's top two are further apart than twice that (a closer pair is a tie either
    may break)."""
    # A and B: one token after their prompts, then one a step; C from step t=4 on
    assert [len(g) for g in ref.generated] == [25, 25, 20]
    worst, ties = 0.0, 0
    for seq in range(3):
        for want, have in zip(ref.logits[seq], got.logits[seq]):
            worst = max(worst, (have - want).abs().max().item())
            top2 = want.topk(2).values
            if top2[0] - top2[1] > 2 * LOGIT_TOLERANCE:
                assert int(have.argmax()) == int(want.argmax())
            else:
                ties += 1
    print(f"max |logit difference| {worst:.4f} over {sum(map(len, ref.logits))} steps "
          f"({ties} near-ties)")
    assert worst <= LOGIT_TOLERANCE


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"], ids=["fp16", "bf16"])
def test_cuda_graphs_compute_what_eager_steps_do(flashinfer, model_path, dtype):
    """The schedule eagerly, then with the decode step's CUDA graphs fed the same
    tokens: the same logits (LOGIT_TOLERANCE; in bf16 four times that, its ulp being
    8x fp16's), the pure decode steps replayed from graphs (3 steps of A and B: the
    graph of 2; then two that C's chunks mix in; then 19 of A, B, C: the graph of 4)."""
    from predd.worker.runner import Runner, RunnerConfig
    prompts = prompts_of(model_path)
    runs = {}
    for graphs in ("off", "on"):
        runner = Runner(RunnerConfig(model_path, device="cuda", dtype=dtype, kv_pages=64,
                                     page_size=PS, attention="flashinfer", cuda_graphs=graphs,
                                     max_batch=8))
        runs[graphs] = run_schedule(runner, prompts, 24, runs["off"].generated if runs else None)
        if graphs == "on":
            assert runner.graphs.sizes == [1, 2, 4, 8]
            assert runner.graphs.replays == 3 + 19
        del runner
        torch.cuda.empty_cache()
    tolerance = LOGIT_TOLERANCE * (4 if dtype == "bfloat16" else 1)
    worst = max((have - want).abs().max().item()
                for seq in range(3) for want, have in zip(runs["off"].logits[seq],
                                                          runs["on"].logits[seq]))
    print(f"{dtype}: max |logit difference| graphs/eager {worst:.4f}")
    assert worst <= tolerance


@pytest.mark.slow
def test_predd_serves_with_flashinfer(flashinfer, model_path, tmp_path):
    import liblip
    from tests.conftest import start_predd
    tokens = {}
    for name in ("torch", "flashinfer"):
        daemon = start_predd(str(tmp_path / name), "--model", model_path, "--device", "cuda",
                             "--dtype", "float16", "--attention", name, "--kv-pages", "256")
        try:
            liblip.connect(daemon.addr)
            info = liblip.info()
            assert info["attention"] == name
            assert info["cuda_graphs"] == (name == "flashinfer"), info["cuda_graphs_reason"]
            prompt = liblip.chat_template([{"role": "user", "content": "Name three colours."}])
            kv = liblip.kv_create()
            tokens[name] = list(liblip.generate(kv, prompt, max_tokens=32, ignore_eos=True))
            liblip.kv_close(kv)
            # the other answers, picked on the device or brought back from it
            kv = liblip.kv_create()
            assert liblip.pred(kv, prompt).argmax() == tokens[name][0]       # a raw row
            assert liblip.pred_topk(kv, tokens[name][:1], 4).ids[0] == tokens[name][1]
            drawn = liblip.pred_sample(kv, tokens[name][1:2], {"temperature": 1.0, "seed": 5},
                                       mask=[11, 12, 13])
            assert drawn.token in (11, 12, 13) and drawn.logprob <= 0.0
            liblip.kv_close(kv)
            # a greedy pred_sample loop, its calls taken while a pass flies (--overlap on)
            kv, token, loop = liblip.kv_create(), None, []
            for step in range(16):
                token = liblip.pred_sample(kv, prompt if step == 0 else [token],
                                           {"temperature": 0.0}).token
                loop.append(token)
            liblip.kv_close(kv)
            assert loop == tokens[name][:16]
            print(f"{name}: {liblip.stats()['answered_in_flight']} requests answered in flight")
            assert liblip.stats()["batch_picks_failed"] == 0     # picked in batches there
            assert liblip.fsck()["clean"]
        finally:
            assert daemon.stop() == 0
    assert len(tokens["torch"]) == 32
    assert tokens["flashinfer"] == tokens["torch"]

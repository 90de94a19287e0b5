"""Tensor parallelism (predd/worker/tp.py) on gloo: SmolLM2-135M (9 query heads, 3 KV heads)
at `--tp 3` against one rank, through the real protocol; a tiny random Llama written
here at TP 2 and 4 (8 query heads; 4 KV heads, or 2, which at TP 4 each two ranks
keep; checked through the runners directly, as it has no tokenizer); a TP that does
not divide the heads; and a rank that dies."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

import liblip
from predd.worker import tp
from tests.conftest import start_predd

pytestmark = pytest.mark.slow

PROMPT = [1, 204, 58, 14, 60, 235, 30, 112]     # ids the tiny Llama below has too


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(TP=1 predd, TP=3 predd), each with a 128-page pool."""
    one = start_predd(str(tmp_path_factory.mktemp("tp1")), "--kv-pages", "128")
    three = start_predd(str(tmp_path_factory.mktemp("tp3")), "--kv-pages", "128", "--tp", "3")
    yield one, three
    for daemon in (one, three):
        liblip.connect(daemon.addr)
        report = liblip.fsck()
        assert report["clean"], report["problems"]
    assert three.stop() == 0
    assert one.stop() == 0


def run(daemon, blob: bytes | None = None) -> dict:
    """On `daemon`: prefill PROMPT (or import `blob`), then the logits after one more
    token on a fork, 8 greedy tokens, pages used around the fork, and the export."""
    lip = liblip
    lip.connect(daemon.addr)
    kv = lip.kv_import(blob) if blob else lip.kv_create()
    prefill = None if blob else lip.pred(kv, PROMPT).logits.copy()
    used = lip.stats()["pages_used"]
    fork = lip.kv_fork(kv)
    shared = lip.stats()["pages_used"] - used
    after = lip.pred(fork, [42]).logits.copy()
    lip.kv_close(fork)
    export = lip.kv_export(kv)
    tokens = list(lip.generate(kv, [42], max_tokens=8, stop=[]))
    lip.kv_close(kv)
    return dict(prefill=prefill, after=after, tokens=tokens, shared=shared, export=export)


def test_tp3_gives_tp1s_logits_and_tokens_and_forks_share_pages(pair):
    one, three = pair
    a, b = run(one), run(three)
    assert np.abs(a["prefill"] - b["prefill"]).max() < 1e-4
    assert np.abs(a["after"] - b["after"]).max() < 1e-4
    assert a["tokens"] == b["tokens"]
    assert a["shared"] == b["shared"] == 0          # a fork takes no page on any rank
    assert len(a["export"]) == len(b["export"])      # the same TP-independent format


def test_an_export_moves_between_tp3_and_tp1(pair):
    one, three = pair
    home = run(three)
    moved = run(one, home["export"])                 # TP=3's cache, read at TP=1
    back = run(three, moved["export"])               # and back
    assert np.abs(home["after"] - moved["after"]).max() < 1e-4
    assert np.abs(home["after"] - back["after"]).max() < 1e-4
    assert home["tokens"] == moved["tokens"] == back["tokens"]


def test_a_tp_that_does_not_divide_the_heads_is_refused(tmp_path):
    proc = subprocess.run(
        [os.sys.executable, "-m", "predd", "--rundir", str(tmp_path), "--dtype", "float32",
         "--kv-pages", "16", "--tp", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--tp 2 does not divide the model's 9 query heads (EINVAL)" in proc.stderr


def test_a_dead_rank_ends_predd_with_one_clear_line_within_30_s(tmp_path):
    daemon = start_predd(str(tmp_path), "--kv-pages", "16", "--tp", "3")
    try:
        ranks = subprocess.run(["pgrep", "-P", str(daemon.proc.pid)], capture_output=True,
                               text=True).stdout.split()
        assert len(ranks) == 2
        os.kill(int(ranks[0]), signal.SIGKILL)
        started = time.monotonic()
        code = daemon.proc.wait(timeout=40)
        assert time.monotonic() - started < 30
    finally:
        daemon.stop()
    assert code == 1
    with open(daemon.log) as f:
        lines = [line for line in f if "predd stops" in line]
    assert len(lines) == 1 and lines[0].startswith("predd: tensor parallel ")
    time.sleep(1)
    assert subprocess.run(["pgrep", "-P", str(daemon.proc.pid)],
                          capture_output=True).stdout == b""    # no rank left behind


def test_a_dead_rank_gives_eio_on_the_mount_and_a_restart_restores_fsynced_caches(tmp_path):
    """kvfsd over `predd --tp 3`: a rank killed → predd gone → EIO, as when a one-rank
    predd dies; predd started again at the same address → the fsync'd cache is back with
    the same tokens and logits (within fp32 noise: an export is gathered whole heads)."""
    from tests.integration.kvfs_fixtures import finish, pred_logits, sh, start_kvfsd
    rundir, state = str(tmp_path / "run"), str(tmp_path / "state")
    args = ("--kv-pages", "32", "--tp", "3", "--lease", "3")
    predd = start_predd(rundir, *args)
    liblip.connect(predd.addr, dead_after_s=60)
    kvfs = start_kvfsd(predd.addr, state)
    try:
        m = kvfs.mount
        assert sh("touch a.kv", cwd=m).returncode == 0
        with liblip.kv_open(f"{m}/a.kv", write=True) as kv:
            liblip.prefill(kv, PROMPT)
        want = pred_logits(liblip, f"{m}/a.kv", 42)
        assert sh("sync a.kv", cwd=m).returncode == 0
        rank = subprocess.run(["pgrep", "-P", str(predd.proc.pid)], capture_output=True,
                              text=True).stdout.split()[0]
        os.kill(int(rank), signal.SIGKILL)
        assert predd.proc.wait(timeout=40) == 1
        r = sh("cat a.kv", cwd=m)
        assert r.returncode == 1 and "Input/output error" in r.stderr
        predd = start_predd(rundir, *args)
        from tests.integration.kvfs_fixtures import eventually
        assert eventually(lambda: "/a.kv: restored" in kvfs.log_text(), timeout=60)
        with liblip.kv_open(f"{m}/a.kv") as kv:
            assert liblip.kv_tokens(kv) == PROMPT
        assert np.abs(pred_logits(liblip, f"{m}/a.kv", 42) - want).max() < 1e-4
    finally:
        finish(kvfs, clear=predd.proc.poll() is None)
        liblip.client().close()
        predd.stop()


# ------------------------------------------------------------------ a tiny random Llama

def tiny_llama(path, kv_heads: int) -> None:
    """A seeded random Llama as a Hugging Face directory, with a word-level tokenizer
    (`t0` .. `t255`) so that predd can serve it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(os.path.join(path, "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)


def chunks():
    """A prefill of 11 tokens on page 5 and a one-token decode on pages [0, 7, 3]
    whose first 35 entries the prefill pass of the same runner wrote before."""
    from predd.engine.chunk import Chunk
    first = Chunk(np.arange(3, 38), np.arange(35), np.array([0, 7, 3]), 35, np.array([34]))
    prefill = Chunk(np.arange(40, 51), np.arange(11), np.array([5]), 11, np.arange(11))
    decode = Chunk(np.array([9]), np.array([35]), np.array([0, 7, 3]), 36, np.array([0]))
    return [[first], [prefill, decode]]


def rank_main(rank: int, world: int, path: str, port: int, out) -> None:
    try:
        rank_work(rank, world, path, port, out)
    except BaseException as exc:        # shown by the test instead of a silent timeout
        out.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def rank_work(rank: int, world: int, path: str, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from predd.worker.runner import Runner, RunnerConfig, TensorParallel
    group = tp.join(world, rank, "cpu")
    runner = Runner(RunnerConfig(path, kv_pages=8, page_size=16),
                    tp=TensorParallel(world, rank, tp.Link(group, torch.device("cpu"))))
    tp.ready()
    if rank:
        tp.serve_rank(runner, runner.tp.link, lambda msg: None)
        tp.leave()
        return
    logits = [torch.cat(runner.execute(step)).numpy() for step in chunks()]
    entries = runner.cache.read_slots(np.arange(0, 16))      # page 0, all heads
    empty = runner.cache.read_slots(np.zeros(0, np.int64))   # nothing sent to the ranks
    runner.stop()
    tp.leave()
    out.put((logits, entries, empty.shape))


def tp_run(path: str, world: int):
    if world == 1:
        from predd.worker.runner import Runner, RunnerConfig
        runner = Runner(RunnerConfig(path, kv_pages=8, page_size=16))
        logits = [torch.cat(runner.execute(step)).numpy() for step in chunks()]
        return (logits, runner.cache.read_slots(np.arange(0, 16)),
                runner.cache.read_slots(np.zeros(0, np.int64)).shape)
    ctx = torch.multiprocessing.get_context("spawn")
    port = tp.free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, path, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    assert not isinstance(result, str), result
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return result


@pytest.mark.parametrize("world,kv_heads", [(2, 4), (4, 4), (4, 2)])
def test_tiny_llama_at_tp_gives_tp1s_logits_and_whole_head_entries(world, kv_heads, tmp_path):
    """(4, 2): more ranks than KV heads, each KV head kept by two ranks."""
    tiny_llama(tmp_path, kv_heads)
    want_logits, want_entries, want_empty = tp_run(str(tmp_path), 1)
    got_logits, got_entries, got_empty = tp_run(str(tmp_path), world)
    assert got_empty == want_empty == (2, 2, 0, kv_heads, 8)
    for want, got in zip(want_logits, got_logits):
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-4
    assert got_entries.shape == want_entries.shape == (2, 2, 16, kv_heads, 8)
    assert np.abs(got_entries - want_entries).max() < 1e-5
    assert np.argmax(got_logits[1], -1).tolist() == np.argmax(want_logits[1], -1).tolist()


def test_two_torchrun_nodes_on_loopback_give_one_ranks_logits(tmp_path):
    """`torchrun --nnodes 2 --node-rank 0/1 -m predd --tp 2`: rank 0 (node 0) serves."""
    model = tmp_path / "tiny"
    model.mkdir()
    tiny_llama(str(model), 4)
    one = start_predd(str(tmp_path / "one"), "--model", str(model), "--kv-pages", "16")
    want = run(one)
    assert one.stop() == 0
    port = tp.free_port()
    torchrun = os.path.join(os.path.dirname(os.sys.executable), "torchrun")
    node = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--module", "predd", "--dtype", "float32",
            "--model", str(model), "--kv-pages", "16", "--tp", "2"]
    (tmp_path / "two").mkdir()
    second = subprocess.Popen([*node[:5], "--node-rank", "1", *node[5:],
                               "--rundir", str(tmp_path / "two")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from predd.server import launch
    first = subprocess.Popen([*node[:5], "--node-rank", "0", *node[5:],
                              "--rundir", str(tmp_path / "two")],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        addr = launch.wait_ready(first, 180)
        assert addr is not None, "rank 0 never served"
        got = run(launch.Daemon(first, addr.split()[0], str(tmp_path / "two"), ""))
    finally:
        launch.terminate(first, 20)    # torchrun itself exits 1 on the SIGTERM it forwards
        second.wait(30)
    assert second.returncode == 0      # rank 1 left on rank 0's STOP
    assert np.abs(got["prefill"] - want["prefill"]).max() < 1e-4
    assert np.abs(got["after"] - want["after"]).max() < 1e-4
    assert got["tokens"] == want["tokens"]

"""Each tensor-parallel layer against its unsharded twin: two processes over gloo, no Ray.

The two ranks load their shards from a real safetensors file through ``get_slice`` (and
record which slice each load asked for), run the layer, and save what they saw; the
test process compares with plain F.linear / F.embedding over the full tensors.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

TP = 2
HIDDEN, HEAD_DIM, NUM_HEADS, INTER, VOCAB, TOKENS = 64, 16, 4, 96, 37, 5


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    t = {
        "x": rnd(TOKENS, HIDDEN),
        "x_inter": rnd(TOKENS, INTER),
        "gate.weight": rnd(INTER, HIDDEN), "up.weight": rnd(INTER, HIDDEN),
        "gate.bias": rnd(INTER), "up.bias": rnd(INTER),
        "down.weight": rnd(HIDDEN, INTER), "down.bias": rnd(HIDDEN),
        "embed.weight": rnd(VOCAB, HIDDEN),
        # Every id, including the last one, which lives on rank 1 next to its padded row.
        "ids": torch.tensor(list(range(VOCAB)) + [VOCAB - 1, 0], dtype=torch.int64),
    }
    for kv in (4, 1):
        t[f"kv{kv}.q.weight"], t[f"kv{kv}.q.bias"] = rnd(NUM_HEADS * HEAD_DIM, HIDDEN), rnd(NUM_HEADS * HEAD_DIM)
        for n in ("k", "v"):
            t[f"kv{kv}.{n}.weight"], t[f"kv{kv}.{n}.bias"] = rnd(kv * HEAD_DIM, HIDDEN), rnd(kv * HEAD_DIM)
    return t


class _Recorder:
    """A safetensors slice that remembers the index each load read."""

    def __init__(self, src, log: list, name: str) -> None:
        self.src, self.log, self.name = src, log, name

    def get_shape(self):
        return self.src.get_shape()

    def __getitem__(self, index):
        self.log.append((self.name, _index_repr(index)))
        return self.src[index]


def _index_repr(index) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    return tuple((s.start, s.stop) for s in index)


def _rank_main(rank: int, port: int, weights: str, out: str) -> None:
    from pagefleet.worker.model_executor.layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from pagefleet.worker.parallel.distributed import destroy_process_groups, init_process_groups

    groups = init_process_groups(rank=rank, world_size=TP, device=torch.device("cpu"), host="127.0.0.1",
                                 port=port, step_timeout_s=60)
    tp, dt = groups.tp, torch.float32
    log: list = []
    result: dict = {"reads": log}
    with safe_open(weights, framework="pt") as f:
        def load(layer, kind, shard, name):
            layer.load(kind, shard, _Recorder(f.get_slice(name), log, name))

        x, x_inter, ids = f.get_tensor("x"), f.get_tensor("x_inter"), f.get_tensor("ids")
        gate_up = ColumnParallelLinear(HIDDEN, [INTER // TP] * 2, True, tp, dt)
        for shard, name in enumerate(("gate", "up")):
            load(gate_up, "weight", shard, f"{name}.weight")
            load(gate_up, "bias", shard, f"{name}.bias")
        result["gate_up"] = gate_up(x)
        for kv in (4, 1):
            qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, kv, True, tp, dt)
            for shard, name in enumerate("qkv"):
                load(qkv, "weight", shard, f"kv{kv}.{name}.weight")
                load(qkv, "bias", shard, f"kv{kv}.{name}.bias")
            result[f"qkv{kv}"] = qkv(x)
            result[f"qkv{kv}_kv_heads"] = qkv.num_kv_heads
        down = RowParallelLinear(INTER, HIDDEN, True, tp, dt)
        load(down, "weight", 0, "down.weight")
        load(down, "bias", 0, "down.bias")
        per_rank = INTER // TP
        result["down"] = down(x_inter[:, rank * per_rank:(rank + 1) * per_rank].contiguous())
        embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp, dt)
        load(embed, "weight", 0, "embed.weight")
        result["embed"] = embed(ids)
        head = ParallelLMHead(VOCAB, HIDDEN, tp, dt)
        load(head, "weight", 0, "embed.weight")
        result["lm_head"] = head.logits(x)
    torch.save(result, out)
    destroy_process_groups()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run both ranks once; {rank: what it saved}, plus the full tensors."""
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("tp_layers")
    full = _full_tensors()
    weights = str(tmp / "weights.safetensors")
    save_file(full, weights)
    # The store lives in this process; both ranks join it as clients.
    store = dist.TCPStore("127.0.0.1", 0, TP, is_master=True, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, store.port, weights, str(tmp / f"rank{r}.pt")))
             for r in range(TP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    codes = [p.exitcode for p in procs]
    if codes != [0] * TP:
        for p in procs:
            p.kill()
        pytest.fail(f"rank processes exited with {codes}")
    return {r: torch.load(tmp / f"rank{r}.pt") for r in range(TP)}, full


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t[..., rank * size:(rank + 1) * size]


def test_merged_gate_up_column_parallel(ranks):
    out, full = ranks
    half = INTER // TP
    gate = F.linear(full["x"], full["gate.weight"], full["gate.bias"])
    up = F.linear(full["x"], full["up.weight"], full["up.bias"])
    for r in range(TP):
        torch.testing.assert_close(out[r]["gate_up"], torch.cat([_rows(gate, r, half), _rows(up, r, half)], -1))


@pytest.mark.parametrize("kv", [4, 1], ids=["kv_split", "kv_replicated"])
def test_qkv_with_bias_splits_or_replicates_kv_heads(ranks, kv):
    out, full = ranks
    q, k, v = (F.linear(full["x"], full[f"kv{kv}.{n}.weight"], full[f"kv{kv}.{n}.bias"]) for n in "qkv")
    q_per_rank = NUM_HEADS // TP * HEAD_DIM
    for r in range(TP):
        local = out[r][f"qkv{kv}"]
        if kv >= TP:
            kv_per_rank = kv // TP * HEAD_DIM
            want_k, want_v = _rows(k, r, kv_per_rank), _rows(v, r, kv_per_rank)
        else:
            # One KV head serves both ranks' query heads: each rank keeps a replica.
            want_k, want_v = k, v
        assert out[r][f"qkv{kv}_kv_heads"] == max(1, kv // TP)
        torch.testing.assert_close(local, torch.cat([_rows(q, r, q_per_rank), want_k, want_v], -1))


def test_row_parallel_all_reduce_adds_bias_once(ranks):
    out, full = ranks
    want = F.linear(full["x_inter"], full["down.weight"], full["down.bias"])
    for r in range(TP):
        torch.testing.assert_close(out[r]["down"], want)
    assert torch.equal(out[0]["down"], out[1]["down"])  # the all-reduce leaves one result on every rank


def test_vocab_parallel_embedding_with_odd_vocab(ranks):
    out, full = ranks
    want = F.embedding(full["ids"], full["embed.weight"])
    for r in range(TP):
        assert torch.equal(out[r]["embed"], want)  # one nonzero term per row: the sum is exact


def test_lm_head_gathers_unpadded_logits_on_rank_0_only(ranks):
    out, full = ranks
    want = F.linear(full["x"], full["embed.weight"])
    assert out[0]["lm_head"].shape == (TOKENS, VOCAB)
    torch.testing.assert_close(out[0]["lm_head"], want)
    assert out[1]["lm_head"] is None


def test_each_rank_reads_only_its_slice(ranks):
    out, _ = ranks
    half_i, q_rows, per_vocab = INTER // TP, NUM_HEADS // TP * HEAD_DIM, -(-VOCAB // TP)

    def qkv_reads(kv: int, kv_rows: tuple) -> list:
        rows = {"q": (q_rows, 2 * q_rows), "k": kv_rows, "v": kv_rows}
        return [(f"kv{kv}.{n}.{kind}", (rows[n],)) for n in "qkv" for kind in ("weight", "bias")]

    # Rank 1 reads the second half of column-parallel rows, the second half of the
    # row-parallel input columns (bias whole), vocab rows [19, 37) for the embedding and
    # the LM head (its padded row 37 is never read), and the one KV head of kv1 whole.
    want = [(f"{n}.{kind}", ((half_i, 2 * half_i),)) for n in ("gate", "up") for kind in ("weight", "bias")]
    want += qkv_reads(4, (2 * HEAD_DIM, 4 * HEAD_DIM)) + qkv_reads(1, (0, HEAD_DIM))
    want += [("down.weight", ((None, None), (half_i, 2 * half_i))), ("down.bias", ((None, None),))]
    want += [("embed.weight", ((per_vocab, VOCAB),))] * 2
    assert out[1]["reads"] == want
    assert ("embed.weight", ((0, per_vocab),)) in out[0]["reads"]
    assert ("down.weight", ((None, None), (0, half_i))) in out[0]["reads"]

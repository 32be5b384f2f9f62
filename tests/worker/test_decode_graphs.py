"""The CUDA-graph path on CPU: the static step buffers and the padded decode and prefill forwards
that CUDA captures as graphs, run eagerly here and held equal to the engine's ordinary path."""

from __future__ import annotations

import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.model_executor.cuda_graphs import decode_buckets, token_buckets
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.model_executor.step_buffers import StepBuffers


def test_buckets_are_powers_of_two_to_eight_then_steps_of_eight_ending_at_max_num_seqs():
    assert decode_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(10) == [1, 2, 4, 8, 10]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]


def test_token_buckets_pad_a_step_by_at_most_a_third_past_512():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16]


def test_a_step_padded_in_tokens_and_sequences_adds_only_empty_sequences_and_kv_free_tokens():
    buffers = StepBuffers(max_tokens=8, max_seqs=4, max_blocks=2, device=torch.device("cpu"))
    buffers.host.fill_(99)
    # A 3-token prompt chunk beside a decode row.
    step = StepInput(input_ids=[5, 6, 7, 8], positions=[0, 1, 2, 9], slot_mapping=[16, 17, 18, 41],
                     block_tables=[[1], [2]], query_start_loc=[0, 3, 4], seq_lens=[3, 10], logits_indices=[2, 3])
    assert buffers.fill(step, pad_tokens=(6, 4)) == 4
    assert buffers.input_ids(6).tolist() == [5, 6, 7, 8, 0, 0]
    assert buffers.positions(6).tolist() == [0, 1, 2, 9, 0, 0]
    assert buffers.slot_mapping(6).tolist() == [16, 17, 18, 41, -1, -1]
    assert buffers.query_start_loc(4).tolist() == [0, 3, 4, 4, 4]  # padding tokens lie past the last sequence
    assert buffers.seq_lens(4).tolist() == [3, 10, 0, 0]
    assert buffers.logits_indices(2).tolist() == [2, 3]


def test_a_padded_decode_step_fills_every_row_and_padding_writes_no_kv():
    buffers = StepBuffers(max_tokens=8, max_seqs=6, max_blocks=3, device=torch.device("cpu"))
    buffers.host.fill_(99)  # stale values from an earlier step
    step = StepInput(input_ids=[7, 8], positions=[20, 3], slot_mapping=[52, 3], block_tables=[[0, 1, 3], [2]],
                     query_start_loc=[0, 1, 2], seq_lens=[21, 4], logits_indices=[0, 1])
    assert buffers.fill(step, pad_to=4) == 4
    assert buffers.input_ids(4).tolist() == [7, 8, 0, 0]
    assert buffers.positions(4).tolist() == [20, 3, 0, 0]
    assert buffers.slot_mapping(4).tolist() == [52, 3, -1, -1]
    assert buffers.query_start_loc(4).tolist() == [0, 1, 2, 3, 4]
    assert buffers.seq_lens(4).tolist() == [21, 4, 1, 1]
    table = buffers.block_table(4)
    # Only the columns a row's seq_len reaches are read: the rest may stay stale.
    assert table[0].tolist() == [0, 1, 3]
    assert table[1, 0] == 2 and table[2, 0] == 0 and table[3, 0] == 0
    assert table.stride() == (3, 1)


def _decode_step(llm, seqs) -> StepInput:
    from pagefleet.worker.model_executor.step_input import build_step_input

    out = llm.engine.scheduler.schedule()
    assert len(out.scheduled) == seqs and all(item.num_new_tokens == 1 for item in out.scheduled)
    return out, build_step_input(out, llm.engine.args.block_size, llm.engine.kv.block_ids)


def test_static_decode_forward_gives_the_ordinary_paths_logits(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
              max_num_seqs=8, enforce_eager=True)
    engine, runner = llm.engine, llm.engine.executor.runner
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate((5, 9, 17)):  # contexts across block boundaries
        engine.add_request(f"r{i}", torch.randint(5, 200, (n,), generator=gen).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the three prefills
    out, step = _decode_step(llm, 3)
    ordinary = runner.execute(step).clone()
    runner.use_graphs(capture=False)
    graphs = runner.decode_graphs
    assert graphs.bucket(3) == 4
    static = runner.execute(step)  # padded to 4 rows; rewrites the same KV slots with the same values
    assert static.shape == ordinary.shape == (3, llm.engine.model_config.vocab_size)
    torch.testing.assert_close(static, ordinary, rtol=1e-5, atol=1e-5)
    assert static.argmax(-1).tolist() == ordinary.argmax(-1).tolist()
    engine.kv.commit_step()
    engine.scheduler.update_from_output(out, engine.sampler(static, out.sampled_seqs()))


def test_an_engine_on_the_static_decode_path_generates_the_same_tokens(tiny_checkpoint):
    """Also with async scheduling, whose steps read their input ids from the previous step's
    sampled tokens into the static buffers on the device."""
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 3 * i + 2))} for i in range(5)]
    # Output lengths apart, so rows of the block table move up as sequences end.
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(5)]

    def generate(static: bool, async_scheduling: bool = False):
        llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
                  max_num_seqs=8, enforce_eager=True, async_output_proc=async_scheduling,
                  async_scheduling=async_scheduling)
        if static:
            llm.engine.executor.runner.use_graphs(capture=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    expected = generate(static=False)
    assert generate(static=True) == expected
    assert generate(static=True, async_scheduling=True) == expected
    assert [len(t) for t in expected] == [12, 15, 18, 21, 24]


def test_a_step_sampling_every_prompt_position_fits_and_keeps_the_block_table():
    # A scoring step samples every position: more logits rows than sequences.
    buffers = StepBuffers(max_tokens=8, max_seqs=2, max_blocks=2, device=torch.device("cpu"))
    step = StepInput(input_ids=[1, 2, 3, 4, 5, 6, 7], positions=list(range(7)), slot_mapping=list(range(7)),
                     block_tables=[[5]], query_start_loc=[0, 7], seq_lens=[7], logits_indices=list(range(7)))
    assert buffers.fits(step)
    tensors = buffers.tensors(step, lambda *a: None)
    assert tensors.logits_indices.tolist() == list(range(7))
    assert tensors.meta.block_table.tolist() == [[5, 0]]
    assert not buffers.fits(StepInput([0] * 9, [0] * 9, [0] * 9, [[0]], [0, 9], [9], [8]))


def test_static_prefill_forward_gives_the_ordinary_paths_logits(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
              max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=True)
    engine, runner = llm.engine, llm.engine.executor.runner
    engine.add_request("a", list(range(5, 30)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.add_request("b", list(range(40, 51)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    from pagefleet.worker.model_executor.step_input import build_step_input

    out = engine.scheduler.schedule()  # a's decode row beside b's 11-token prompt: 12 tokens
    step = build_step_input(out, engine.args.block_size, engine.kv.block_ids)
    assert (len(step.input_ids), len(step.seq_lens)) == (12, 2)
    ordinary = runner.execute(step).clone()
    runner.use_graphs(capture=False)
    assert runner.prefill_graphs.bucket(12) == 16
    static = runner.execute(step)  # 16 tokens, 8 sequences
    torch.testing.assert_close(static, ordinary, rtol=1e-5, atol=1e-5)
    assert static.shape == (2, engine.model_config.vocab_size)

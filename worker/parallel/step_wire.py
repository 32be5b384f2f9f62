"""A StepInput as int64 tensors, broadcast from rank 0 to the other tensor-parallel ranks.

Why a packed tensor over gloo rather than a Ray call per step: the ranks 1..N-1 sit in
a receive loop, so a step costs two small gloo broadcasts on the local host instead of a
Ray task round trip, and what travels is plain integers — no pickle of arbitrary classes
from a socket.

Each message is a fixed-size header (command, payload length) and then, for a step, the
payload: ``[T, B, S, L, input_ids(T), positions(T), slot_mapping(T), query_start_loc(B+1),
seq_lens(B), logits_indices(S), block_table_lens(B), block_tables(sum of lens), lora_ids(L)]``,
where L is 0 (no LoRA row) or B, and a row of the base model is 0 there (adapter ids are >= 1).
An adapter to register (``ADD_LORA``) is ``[lora_int_id, name bytes N, path bytes P, name(N),
path(P)]``, each UTF-8 byte one value; one to forget (``REMOVE_LORA``) is ``[lora_int_id]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.model_executor.step_input import StepInput

STOP = 0
STEP = 1
ADD_LORA = 2
REMOVE_LORA = 3
_HEADER_LEN = 2


def pack_step(step: StepInput) -> torch.Tensor:
    """[payload_len] int64 in the layout of the module docstring."""
    num_tokens, num_seqs = len(step.input_ids), len(step.seq_lens)
    if not (len(step.positions) == len(step.slot_mapping) == num_tokens
            and len(step.block_tables) == num_seqs and len(step.query_start_loc) == num_seqs + 1):
        raise ValueError("inconsistent StepInput: "
                         f"{num_tokens} input ids, {len(step.positions)} positions, {len(step.slot_mapping)} slots, "
                         f"{num_seqs} seq_lens, {len(step.block_tables)} block tables, "
                         f"{len(step.query_start_loc)} query starts")
    if step.prev_token_rows:  # the other ranks cannot read rank 0's sampled tokens on its device
        raise ValueError("a step that reads the previous step's tokens on the device runs on one rank only")
    if step.lora_ids and len(step.lora_ids) != num_seqs:
        raise ValueError(f"inconsistent StepInput: {len(step.lora_ids)} lora ids for {num_seqs} sequences")
    values = [num_tokens, num_seqs, len(step.logits_indices), len(step.lora_ids)]
    values += step.input_ids + step.positions + step.slot_mapping
    values += step.query_start_loc + step.seq_lens + step.logits_indices
    values += [len(row) for row in step.block_tables]
    for row in step.block_tables:
        values += row
    values += [0 if i is None else i for i in step.lora_ids]
    return torch.tensor(values, dtype=torch.int64)


def unpack_step(payload: torch.Tensor) -> StepInput:
    """Inverse of ``pack_step``. payload: [payload_len] int64."""
    values = payload.tolist()
    num_tokens, num_seqs, num_logits, num_lora_ids = values[:4]
    pos = 4

    def take(n: int) -> list[int]:
        nonlocal pos
        out = values[pos:pos + n]
        pos += n
        return out

    input_ids, positions, slots = take(num_tokens), take(num_tokens), take(num_tokens)
    query_start_loc, seq_lens, logits_indices = take(num_seqs + 1), take(num_seqs), take(num_logits)
    tables = [take(n) for n in take(num_seqs)]
    lora_ids = [i or None for i in take(num_lora_ids)]
    if pos != len(values):
        raise ValueError(f"step payload has {len(values)} values, the layout accounts for {pos}")
    return StepInput(input_ids, positions, slots, tables, query_start_loc, seq_lens, logits_indices,
                     lora_ids=lora_ids)


def pack_lora(request: LoRARequest) -> torch.Tensor:
    """[payload_len] int64: an adapter to register, in the layout of the module docstring."""
    name, path = request.lora_name.encode(), request.lora_path.encode()
    return torch.tensor([request.lora_int_id, len(name), len(path), *name, *path], dtype=torch.int64)


def unpack_lora(payload: torch.Tensor) -> LoRARequest:
    values = payload.tolist()
    lora_int_id, n_name, n_path = values[:3]
    if len(values) != 3 + n_name + n_path:
        raise ValueError(f"adapter payload has {len(values)} values, the layout accounts for {3 + n_name + n_path}")
    name, path = bytes(values[3:3 + n_name]).decode(), bytes(values[3 + n_name:]).decode()
    return LoRARequest(name, lora_int_id, path)


def broadcast_step(step: StepInput, group) -> None:
    """Rank 0: send the step to every rank of ``group``."""
    payload = pack_step(step)
    dist.broadcast(torch.tensor([STEP, payload.numel()], dtype=torch.int64), _src(group), group=group)
    dist.broadcast(payload, _src(group), group=group)


def broadcast_add_lora(request: LoRARequest, group) -> None:
    """Rank 0: have every rank of ``group`` register an adapter (``ModelRunner.add_lora``)."""
    payload = pack_lora(request)
    dist.broadcast(torch.tensor([ADD_LORA, payload.numel()], dtype=torch.int64), _src(group), group=group)
    dist.broadcast(payload, _src(group), group=group)


def broadcast_remove_lora(lora_int_id: int, group) -> None:
    """Rank 0: have every rank of ``group`` forget an adapter (``ModelRunner.remove_lora``)."""
    dist.broadcast(torch.tensor([REMOVE_LORA, 1], dtype=torch.int64), _src(group), group=group)
    dist.broadcast(torch.tensor([lora_int_id], dtype=torch.int64), _src(group), group=group)


def broadcast_stop(group) -> None:
    """Rank 0: tell the receive loops to return."""
    dist.broadcast(torch.tensor([STOP, 0], dtype=torch.int64), _src(group), group=group)


def receive_step(group) -> StepInput | LoRARequest | int | None:
    """Ranks 1..N-1: the next step from rank 0, an adapter to register, the lora_int_id of one to
    forget, or None when rank 0 says stop."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, _src(group), group=group)
    command, length = header.tolist()
    if command == STOP:
        return None
    if command not in (STEP, ADD_LORA, REMOVE_LORA):
        raise ValueError(f"unknown command {command} from tensor-parallel rank 0")
    payload = torch.empty(length, dtype=torch.int64)
    dist.broadcast(payload, _src(group), group=group)
    if command == REMOVE_LORA:
        return int(payload[0])
    return unpack_step(payload) if command == STEP else unpack_lora(payload)


def _src(group) -> int:
    return dist.get_global_rank(group, 0)

"""RecycledBuffers: a batch's memory is reused only once nothing refers to it."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 (registers torch's reductions with ForkingPickler)

from datamodules.plan.recycled_buffers import RecycledBuffers, nbytes_of, release_returned, views


def test_in_process_a_buffer_is_reused_only_once_no_tensor_refers_to_it() -> None:
    buffers = RecycledBuffers(slots=2)
    first, ticket = buffers.take(1024, shared=False)
    assert ticket is None and first.numel() >= 1024
    pointer, held = first.data_ptr(), first[4:8]  # a view keeps the storage too
    del first
    second, _ = buffers.take(1024, shared=False)
    assert second.data_ptr() != pointer
    del held, second
    assert buffers.take(1024, shared=False)[0].data_ptr() == pointer


def test_a_full_pool_makes_one_off_buffers_and_a_larger_request_replaces_a_free_one() -> None:
    buffers = RecycledBuffers(slots=1)
    kept, _ = buffers.take(64, shared=False)
    extra, _ = buffers.take(64, shared=False)  # the one slot is in use
    assert extra.data_ptr() != kept.data_ptr()
    del kept, extra
    larger, _ = buffers.take(4096, shared=False)
    assert larger.numel() >= 4096


def test_a_workers_buffer_comes_back_once_the_main_process_lets_go_even_of_a_batch_never_read() -> None:
    worker = RecycledBuffers(slots=2)
    buffer, ticket = worker.take(256, shared=True)
    assert buffer.is_shared() and ticket is not None
    # What the main process receives (torch's reductions map the same shared memory): the batch, and
    # no ticket, which set the buffer aside as it was unpickled, so that a batch the DataLoader drops
    # unread (an abandoned iterator's prefetch) comes back too.
    received, arrived = ForkingPickler.loads(ForkingPickler.dumps((buffer[:16], ticket)))
    assert arrived is None
    del buffer, ticket
    release_returned()
    assert worker.take(256, shared=True)[0].data_ptr() != received.data_ptr()  # still held: a second slot
    pointer = received.data_ptr()
    del received
    release_returned()
    assert worker.take(256, shared=True)[0].data_ptr() == pointer


def test_a_buffer_received_under_inference_mode_comes_back_outside_it() -> None:
    # Validation and test batches arrive under inference mode; the next training batch gives them back.
    worker = RecycledBuffers(slots=1)
    buffer, ticket = worker.take(256, shared=True)
    with torch.inference_mode():
        received, _ = ForkingPickler.loads(ForkingPickler.dumps((buffer[:16], ticket)))
    pointer = received.data_ptr()
    del buffer, ticket, received
    release_returned()
    assert worker.take(256, shared=True)[0].data_ptr() == pointer


def test_views_lay_tensors_out_one_after_another_without_overlap() -> None:
    layout = {"ids": ((3, 5), torch.int64), "states": ((3, 5, 2, 4), torch.bfloat16), "mask": ((3,), torch.uint8)}
    tensors = views(torch.empty(nbytes_of(layout), dtype=torch.uint8), layout)
    for value, tensor in enumerate(tensors.values()):
        tensor.fill_(value + 1)
    assert [int(t.flatten()[0]) for t in tensors.values()] == [1, 2, 3]
    assert all(t.is_contiguous() and tuple(t.shape) == layout[k][0] for k, t in tensors.items())

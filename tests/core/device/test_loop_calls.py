"""The window's key asked from the event loop with no worker thread (``DeviceClient.on_loop.handoff``, issue 34
item 2), against a real device process: the same grant as the blocking call, refusals typed, and the control
channel in step afterwards (a cancelled wait still reads its answer)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import DeviceProcess, device_process

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import StaleEpochError, WindowError
from gputravel.core.protocol import Direction, provisioning_key

BUFFER = 64 * 1024


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceProcess]:
    with device_process(Path(tmp_path_factory.mktemp("loop-calls")), buffer_bytes=BUFFER) as d:
        yield d


def _close_open_window(client: DeviceClient) -> None:
    status = client.window_status()
    if status.open and status.epoch is not None:
        client.close_window(epoch=status.epoch)


def test_a_window_key_asked_from_the_loop_is_the_key_the_session_derives(dev: DeviceProcess) -> None:
    client: DeviceClient = dev.client
    epoch = client.window_status().epoch or 0
    epoch += 1
    grant = asyncio.run(client.on_loop.handoff(epoch=epoch, offset=4096, length=8192, chunk_size=4096))
    assert client.secrets is not None
    want = provisioning_key(client.secrets.master, client.secrets.session_id, epoch=epoch, offset=4096, length=8192,
                            direction=Direction.HOLDER_TO_DEVICE)
    assert grant.provisioning_key.key == want.key and grant.key_fingerprint == want.fingerprint
    assert grant.relayed is False
    status = client.window_status()  # the blocking call right after reads its own answer: the channel is in step
    assert status.open and status.epoch == epoch
    closed = client.close_window(epoch=epoch)
    assert closed.epoch == epoch and closed.chunks == 0


def test_refusals_from_the_loop_are_typed_and_leave_the_channel_in_step(dev: DeviceProcess) -> None:
    client: DeviceClient = dev.client
    _close_open_window(client)
    epoch = client.handoff(epoch=100, offset=0, length=4096, chunk_size=4096).provisioning_key.epoch
    client.close_window(epoch=epoch)
    with pytest.raises(StaleEpochError):
        asyncio.run(client.on_loop.handoff(epoch=epoch, offset=0, length=4096, chunk_size=4096))
    with pytest.raises(WindowError):
        asyncio.run(client.on_loop.handoff(epoch=epoch + 1, offset=0, length=BUFFER + 1, chunk_size=4096))
    assert not client.window_status().open
    grant = asyncio.run(client.on_loop.handoff(epoch=epoch + 2, offset=0, length=4096, chunk_size=4096))
    assert client.window_status().epoch == grant.provisioning_key.epoch == epoch + 2
    client.close_window(epoch=epoch + 2)


def test_a_cancelled_wait_still_reads_its_answer_off_the_loop(dev: DeviceProcess) -> None:
    """The cancelled wait's answer is read by a worker thread, which frees the link only then: the loop was never
    blocked on the socket, and the next request (from any thread) reads its own answer."""
    client: DeviceClient = dev.client
    _close_open_window(client)
    epoch = 200
    drained = client.on_loop.drained

    async def ask_then_cancel() -> None:
        task = asyncio.create_task(client.on_loop.handoff(epoch=epoch, offset=0, length=4096, chunk_size=4096))
        await asyncio.sleep(0)  # the request is written; the task waits for the answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(ask_then_cancel())
    status = client.window_status()  # waits for the link, then reads its own answer: not the stale grant
    assert client.on_loop.drained == drained + 1
    assert status.open and status.epoch == epoch
    client.close_window(epoch=epoch)


def test_the_loop_call_waits_its_turn_behind_another_threads_request(dev: DeviceProcess) -> None:
    """Where another thread holds the link mid-request, the loop's call goes through a worker thread (``call``
    waits for the lock) rather than interleaving its bytes."""
    client: DeviceClient = dev.client
    _close_open_window(client)

    async def with_link_held() -> int:
        lock = client._lock
        lock.acquire()
        task = asyncio.create_task(client.on_loop.handoff(epoch=300, offset=0, length=4096, chunk_size=4096))
        await asyncio.sleep(0.05)
        assert not task.done()  # queued behind the holder of the link
        lock.release()
        return (await task).provisioning_key.epoch

    assert asyncio.run(with_link_held()) == 300
    assert client.window_status().epoch == 300
    client.close_window(epoch=300)

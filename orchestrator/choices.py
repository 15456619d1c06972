"""A request's choices (GenerateRequest.n): one Generation each, seeded from (seed, index), run side by side.

The prompt is prefilled once: choice 0 runs alone until both its sessions hold the prompt, and the others, started
then, take it from the model servers' prefix caches. From there on the choices run at once (the model servers batch
their calls) and their messages come out as they are made. One choice's error ends the request; a request that ends
for any reason (its client left) cancels every choice, and each choice's sessions are freed once it is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable

from orchestrator.generation import Generation
from specdec.v1 import generation_pb2 as gen_pb


def choice_seed(seed: int, index: int) -> int:
    """Choice index's seed: the request's own for choice 0 (so that n = 1 changes nothing), else 64 bits of a hash of
    (seed, index); a request for one choice with it returns that choice."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little")


def prefilled(gen: Generation) -> bool:
    """Whether a choice's sessions hold the prompt on both servers: the target's from its first round on, the
    draft's once a round drafted (the second by default); after two rounds the others wait no longer."""
    return bool(gen.target.mirror) and (bool(gen.draft.mirror) or gen.stats.rounds >= 2)


async def interleave(
    gens: list[Generation], release: Callable[[Generation], None]
) -> AsyncIterator[tuple[int, gen_pb.GenerateResponse]]:
    """(index, message) of every choice, as they come, each choice's in order; release(gen) once each is over,
    however it ended. Raises the first error of any choice; closing it cancels the choices still running."""
    if len(gens) == 1:  # one choice runs in the caller's task, as it always did
        try:
            async with contextlib.aclosing(gens[0].run()) as messages:
                async for msg in messages:
                    yield 0, msg
        finally:
            release(gens[0])
        return
    out: asyncio.Queue = asyncio.Queue()  # (index, message, error)
    started = asyncio.Event()  # choice 0's sessions hold the prompt (or it is over)

    async def run(i: int, gen: Generation) -> None:
        try:
            if i:
                await started.wait()
            async with contextlib.aclosing(gen.run()) as messages:
                async for msg in messages:
                    if not i and prefilled(gen):
                        started.set()
                    out.put_nowait((i, msg, None))
        except Exception as e:  # handed to the request, which raises it
            out.put_nowait((i, None, e))
        finally:
            started.set()
            release(gen)

    tasks = [asyncio.ensure_future(run(i, gen)) for i, gen in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            i, msg, error = await out.get()
            if error is not None:
                raise error
            running -= msg.HasField("stats")
            yield i, msg
    finally:
        for task in tasks:
            task.cancel()

"""Two draft replicas in front of one verifier: spreading, a replica dying mid-stream, rejoining."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.launcher import Stack, StackSpec
from services.scheduler.client import AsyncClient, Client, ClientError
from tests.stack_fixtures import PROMPTS, build_checkpoint


def test_replica_death_ends_its_requests_and_spares_the_rest(tmp_path):
    ckpt = build_checkpoint(tmp_path)
    spec = StackSpec(model_path=str(ckpt), scheduler_port=0, draft_replicas=2)
    with Stack(spec) as stack:
        with Client(stack.scheduler_address) as c:
            expected = {p: c.generate(p, max_tokens=60, ignore_eos=True).token_ids for p in PROMPTS[:8]}

        async def scenario():
            async with AsyncClient(stack.scheduler_address) as client:
                started = asyncio.Event()
                seen = [0]

                async def one(p):
                    toks = []
                    async for chunk in client.stream(p, max_tokens=60, ignore_eos=True):
                        toks += chunk.token_ids
                        seen[0] += 1
                        if seen[0] >= 16:
                            started.set()
                    return toks

                tasks = [asyncio.create_task(one(p)) for p in PROMPTS[:8]]
                await started.wait()
                stack.process("draft-1").kill()
                killed = time.monotonic()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                return results, time.monotonic() - killed

        results, took = asyncio.run(scenario())
        failed = [r for r in results if isinstance(r, ClientError)]
        ok = [(p, r) for p, r in zip(PROMPTS[:8], results) if not isinstance(r, BaseException)]
        assert failed and ok, "\n".join(repr(r)[-200:] for r in results)   # spread over both replicas
        assert all(e.code == grpc.StatusCode.UNAVAILABLE for e in failed)
        assert all(r == expected[p] for p, r in ok)         # the survivors were not disturbed
        assert took < 30
        with Client(stack.scheduler_address) as c:          # new requests go to the live replica
            for p in PROMPTS[:4]:
                assert c.generate(p, max_tokens=60, ignore_eos=True).token_ids == expected[p]
        stack.restart("draft-1")                            # a restarted replica rejoins

        async def burst():
            async with AsyncClient(stack.scheduler_address) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=60, ignore_eos=True)
                                              for p in PROMPTS[:8]))

        time.sleep(1.5)
        outs = asyncio.run(burst())
        assert [o.token_ids for o in outs] == [expected[p] for p in PROMPTS[:8]]
        # Prove draft-1 really rejoined: with draft-0 gone, requests are served by draft-1 alone.
        stack.process("draft-0").kill()
        stack.process("draft-0").wait()
        with Client(stack.scheduler_address) as c:
            outcomes = []
            for p in PROMPTS[:3]:
                try:
                    outcomes.append(c.generate(p, max_tokens=20, ignore_eos=True).token_ids == expected[p][:20])
                except ClientError as exc:   # at most the first one can land on draft-0 before it is marked down
                    assert exc.code == grpc.StatusCode.UNAVAILABLE
                    outcomes.append(None)
        assert outcomes[1:] == [True, True], outcomes

import sys

import anyio

import aiollama

MODEL = sys.argv[1] if len(sys.argv) > 1 else None  # None: the default model, fetched on first use


async def main() -> None:
    async with aiollama.Engine(MODEL, n_ctx=8192, n_seq_max=16) as engine:
        conv = engine.conversation()
        conv.prompt("The capital of France is")  # appends; never blocks
        async for chunk in conv.stream(max_tokens=32, temperature=0.7, seed=42, stop=["\n\n"]):
            print(chunk.text, end="", flush=True)  # whole UTF-8 characters, never a stop string
        child = conv.fork()  # shares the KV cells of the common prefix
        completion = await child.stream(max_tokens=16)  # awaiting collects: .text .tokens .finish_reason
        async with engine.conversation() as talk:
            reply = await talk.chat("Hello!", max_tokens=32)  # in the model's own chat template
        print("\n" + completion.finish_reason, repr(reply.text), engine.statistics().tokens_generated)
        await child.aclose()
        await conv.aclose()


anyio.run(main, backend=sys.argv[2] if len(sys.argv) > 2 else "asyncio")

"""TCP proxy for benches/h2window: every chunk is held a fixed time in each
direction, so RTT = 2 × delay while bandwidth stays local.

    python3 delay.py LISTEN_PORT TARGET_PORT ONE_WAY_DELAY_SECONDS
"""
import asyncio, sys, time
LISTEN, TARGET, DELAY = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

async def pipe(reader, writer):
    q = asyncio.Queue()
    async def rd():
        while True:
            data = await reader.read(1 << 16)
            await q.put((time.monotonic() + DELAY, data))
            if not data:
                return
    async def wr():
        while True:
            due, data = await q.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                writer.close(); return
            writer.write(data); await writer.drain()
    await asyncio.gather(rd(), wr(), return_exceptions=True)

async def handle(cr, cw):
    ur, uw = await asyncio.open_connection("127.0.0.1", TARGET)
    await asyncio.gather(pipe(cr, uw), pipe(ur, cw), return_exceptions=True)

async def main():
    srv = await asyncio.start_server(handle, "127.0.0.1", LISTEN)
    async with srv:
        await srv.serve_forever()
asyncio.run(main())

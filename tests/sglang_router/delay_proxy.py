"""A TCP proxy that forwards what clients send DELAY seconds late (answers
are not delayed): `python delay_proxy.py LISTEN_PORT TARGET_PORT DELAY`.
Put in front of a prefill worker's HTTP port, it makes the prefill see each
request after decode has reserved its pages."""

import asyncio
import sys


async def pipe(reader, writer, delay):
    try:
        while data := await reader.read(65536):
            if delay:
                await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(listen, target, delay):
    async def handle(client_r, client_w):
        try:
            worker_r, worker_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, worker_w, delay), pipe(worker_r, client_w, 0))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))

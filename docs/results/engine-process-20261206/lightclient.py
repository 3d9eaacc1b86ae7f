"""A load generator that costs the server's host little: raw asyncio sockets, one POST per request, each
stream read as bytes until its end; only the last event (usage) is parsed. Output tok/s = completion tokens /
wall time of the burst."""
import asyncio, json, time


async def one(host, port, path, body):
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(b"POST " + path.encode() + b"/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
    await writer.drain()
    tail = b""
    events = 0
    while True:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        events += chunk.count(b"data: ")
        tail = (tail + chunk)[-4096:]
    writer.close()
    i = tail.rfind(b'"usage":')
    if i < 0:
        raise RuntimeError(tail[-500:])
    usage = json.loads(tail[i + 8:tail.index(b"}", i) + 1])
    return usage["completion_tokens"], events


async def burst(url, model, requests, stream=True):
    hostport, _, path = url.split("//")[1].partition("/")
    host, port = hostport.split(":")
    port, path = int(port), ("/" + path).rstrip("/")
    bodies = [{"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len, "ignore_eos": True,
               "temperature": 0, "stream": stream, "stream_options": {"include_usage": True}} for r in requests]
    start = time.monotonic()
    results = await asyncio.gather(*(one(host, port, path, b) for b in bodies))
    wall = time.monotonic() - start
    return sum(r[0] for r in results) / wall, sum(r[1] for r in results)

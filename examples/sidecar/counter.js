// A sharded counter for natshard's HTTP sidecar (docs/SIDECAR.md); Node.js 18+, no package.
const http = require("node:http");

http.createServer(async (req, res) => {
  const [, kind, type, id] = req.url.split("/");
  let by = "";
  for await (const chunk of req) by += chunk;
  if (req.method === "GET") return res.end("ok"); // GET /healthz
  if (kind !== "entities") return res.writeHead(404).end(); // /activate and /stop: not needed
  if (!/^\d*$/.test(by)) return res.writeHead(400).end();
  const url = `${req.headers["natshard-state-url"]}/state/${type}/${id}`;
  let count, put;
  for (let attempt = 0; attempt < 2; attempt++) { // compare-and-set: on a conflict (412), read again and retry once
    const got = await fetch(url), saved = await got.text();
    count = (got.ok ? JSON.parse(saved).count : 0) + Number(by || 1);
    put = await fetch(url, { method: "PUT", headers: { "If-Match": got.headers.get("ETag") }, body: JSON.stringify({ count }) });
    await put.text();
    if (put.status !== 412) break;
  }
  res.writeHead(put.status === 204 ? 200 : 500).end(JSON.stringify({ count }));
}).listen(Number(process.env.PORT || 8080), "127.0.0.1");

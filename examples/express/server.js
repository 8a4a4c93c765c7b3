'use strict';
// An Express service whose POST /charges is idempotent through idemcoord:
// one line installs the middleware, and a retried or duplicated charge
// (same Idempotency-Key) books one charge and replays its answer.
//
//   IDEMCOORD_ADDR=127.0.0.1:50051 IDEMCOORD_TOKEN=... node server.js
//   curl -i -X POST localhost:3000/charges -H 'Idempotency-Key: order-1' -d '{"amount":500}'

const express = require('express');
const { Client, httpMiddleware, markSideEffect } = require('idemcoord');

/** The app and its side effect: the charges it booked (count them with GET /charges). */
function createApp(client) {
  const charges = [];
  const app = express();
  // One caller (the shop's backend) sends every key, so keys need no end user folded in; a
  // service whose end users send their own keys passes principal: (req) => their user id.
  app.use(httpMiddleware(client, { requireKey: true, methods: ['POST'], scope: 'express-charges', withoutPrincipal: true }));
  app.use(express.json());
  app.post('/charges', (req, res) => {
    const amount = Number(req.body?.amount);
    if (!(amount > 0)) {
      res.status(400).json({ error: 'amount must be positive' }); // not stored: fix the request, retry with the key
      return;
    }
    markSideEffect(); // from here on, a failure is recorded UNKNOWN, never retried blindly
    const charge = { id: `ch_${charges.length + 1}`, amount };
    charges.push(charge);
    res.status(201).location(`/charges/${charge.id}`).json(charge);
  });
  app.get('/charges', (req, res) => res.json({ count: charges.length, charges }));
  return { app, charges };
}

if (require.main === module) {
  const client = new Client(process.env.IDEMCOORD_ADDR ?? '127.0.0.1:50051', { token: process.env.IDEMCOORD_TOKEN ?? '' });
  const { app } = createApp(client);
  const port = Number(process.env.PORT ?? 3000);
  app.listen(port, () => console.log(`charges service on http://localhost:${port}`));
}

module.exports = { createApp };

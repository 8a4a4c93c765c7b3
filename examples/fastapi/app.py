"""A FastAPI service whose POST /charges is idempotent through idemcoord.

One line installs the middleware; a retried or duplicated charge (same
Idempotency-Key) books one charge and replays its answer.

    PYTHONPATH=../../clients/python IDEMCOORD_ADDR=127.0.0.1:50051 IDEMCOORD_TOKEN=... \\
        /usr/bin/python3 -m uvicorn app:app --port 8000
    curl -i -X POST localhost:8000/charges -H 'Idempotency-Key: order-1' \\
        -H 'Content-Type: application/json' -d '{"amount":500}'
"""

import os
import threading

import fastapi
import fastapi.responses

import idemcoord
from idemcoord.asgi import IdempotencyMiddleware


def create_app(client):
    """The app; app.state.charges is its side effect, the charges it booked (GET /charges counts them)."""
    app = fastapi.FastAPI()
    # One caller (the shop's backend) sends every key, so keys need no end user folded in; a
    # service whose end users send their own keys passes principal=<a function of the request>.
    app.add_middleware(IdempotencyMiddleware, client=client, require_key=True, methods=["POST"],
                       scope="fastapi-charges", without_principal=True)
    app.state.charges = []
    lock = threading.Lock()

    @app.post("/charges", status_code=201)
    async def charge(request: fastapi.Request):
        body = await request.json()
        amount = body.get("amount", 0) if isinstance(body, dict) else 0
        if not isinstance(amount, int) or amount <= 0:
            # not stored: the client may fix the request and retry with the key
            return fastapi.responses.JSONResponse({"error": "amount must be positive"}, 400)
        idemcoord.mark_side_effect()  # from here on, a failure is recorded UNKNOWN, never retried blindly
        with lock:
            c = {"id": "ch_%d" % (len(app.state.charges) + 1), "amount": amount}
            app.state.charges.append(c)
        return fastapi.responses.JSONResponse(c, 201, headers={"Location": "/charges/" + c["id"]})

    @app.get("/charges")
    async def charges():
        return {"count": len(app.state.charges), "charges": app.state.charges}
    return app


if os.environ.get("IDEMCOORD_ADDR"):
    app = create_app(idemcoord.Client(os.environ["IDEMCOORD_ADDR"], token=os.environ.get("IDEMCOORD_TOKEN")))

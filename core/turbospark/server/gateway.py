"""What SGLang's model gateway (``sglang-router``) reads from a worker.

When a worker is added, the gateway asks it for ``/get_server_info`` and
``/get_model_info`` (falling back to ``/server_info`` and ``/model_info``) and
turns the answers into the worker's labels: the model it serves
(``served_model_name``, else ``model_path``), ``tp_size``, ``dp_size``. Then it
polls ``/health``. Its cache-aware policy keeps its own approximate radix tree of
the text it routed to each worker, so it needs nothing else from us. Field
names are SGLang's (its ``ServerInfo`` and ``GetModelInfoResponse``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from turbospark.server.service import Service


def _service(request: Request) -> Service:
    return request.app.state.service


def _group_size(service: Service) -> int:
    group = service.runner.group
    return 1 if group is None else group.size()


async def server_info(request: Request) -> Response:
    service = _service(request)
    return JSONResponse(
        {
            "model_path": service.model_id,
            "served_model_name": service.model_id,
            "is_generation": True,
            "model_type": service.runner.arch.model_type,
            "architectures": None,
            "tp_size": _group_size(service),
            "dp_size": 1,
            "max_batch_size": service.engine.max_batch,
            "max_running_requests": service.engine.max_batch,
            "max_prefill_tokens": service.chunk_size,
            "context_length": service.runner.context_length,
            "session_slots": service.runner.session_pool_size,
        }
    )


async def model_info(request: Request) -> Response:
    service = _service(request)
    eos = service.codec.eos_token_ids
    return JSONResponse(
        {
            "model_path": service.model_id,
            "served_model_name": service.model_id,
            "tokenizer_path": None,
            "is_generation": True,
            "model_type": service.runner.arch.model_type,
            "architectures": None,
            "max_context_length": service.runner.context_length,
            "vocab_size": service.runner.vocab_size,
            "supports_vision": False,
            "eos_token_ids": sorted(eos),
        }
    )


ROUTES = [
    Route("/get_server_info", server_info, methods=["GET"]),
    Route("/server_info", server_info, methods=["GET"]),
    Route("/get_model_info", model_info, methods=["GET"]),
    Route("/model_info", model_info, methods=["GET"]),
]

"""The controller's HTTP endpoints for enrollment, mounted on `omlx serve`.

A join code is the credential for `claim` and the claim's token for `register`, so these
two need no API key (a worker has none); rotation changes what every worker trusts, so it
takes the server's key and an explicit `{"confirm": true}`. They are plain `def` handlers:
scrypt and SSH run on the thread pool, never on the event loop.
"""

from fastapi import APIRouter, Depends, Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, Field

from omlx_core.cluster import controller
from omlx_core.cluster.invites import CodeRefused
from omlx_core.errors import InputError, OmlxError
from omlx_core.serve.errors import APIError, bad_request


class Claim(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=63)


class Register(BaseModel):
    model_config = ConfigDict(extra="ignore")
    registration_token: str = Field(min_length=1, max_length=200)
    worker: dict


class Rotate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    confirm: bool = False


def _api_error(error: OmlxError) -> APIError:
    if isinstance(error, CodeRefused):
        return APIError(403, str(error), "permission_error", "code", "join_code_refused")
    if isinstance(error, InputError):
        return bad_request(str(error))
    return APIError(409, str(error), "invalid_request_error", None, "cluster_conflict")


def cluster_routes(server, authorize) -> APIRouter:
    router = APIRouter(prefix="/api/cluster")

    @router.post("/claim")
    def claim(body: Claim):
        try:
            return controller.claim(server.home, server.settings, body.code, body.name)
        except OmlxError as error:
            raise _api_error(error) from error

    @router.post("/register")
    def register(body: Register, http: HTTPRequest):
        try:
            return controller.register(server.home, server.settings, body.registration_token, body.worker,
                                       http.client.host if http.client else "")
        except OmlxError as error:
            raise _api_error(error) from error

    @router.post("/rotate-key", dependencies=[Depends(authorize)])
    def rotate_key(body: Rotate):
        from omlx_core.cluster.rotate import rotate

        if not body.confirm:
            raise bad_request('rotating the controller key needs {"confirm": true}', "confirm")
        try:
            return rotate(server.home, server.settings, confirm=True)
        except OmlxError as error:
            raise _api_error(error) from error

    return router

"""When a request stops: the checks made after each token it samples (vLLM V1's
`check_stop`). Stop strings are the front-end's (frontend/detokenizer.py)."""
from __future__ import annotations

from tidal.core.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> bool:
    """Check the request after `token_id` was appended to it: feed its grammar (ValueError,
    the request fails alone, if the grammar forbids the token), then set its FINISHED_* status
    (and `stop_reason`) if it stops here. Returns whether it is finished."""
    sp = request.sampling_params
    num_output = request.num_output_tokens
    if (so := request.structured_output_request) is not None:
        so.accept_token(token_id)
        if so.is_terminated():  # the grammar reached its end (on a stop token)
            request.status = RequestStatus.FINISHED_STOPPED
    if num_output >= sp.min_tokens:
        if token_id == request.eos_token_id and not sp.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
    if not request.is_finished() and (num_output >= request.max_tokens or request.num_tokens >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request.is_finished()

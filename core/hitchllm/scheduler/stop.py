"""Stop conditions checked after each sampled token (stop strings are the detokenizer's)."""

from __future__ import annotations

from hitchllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status ``request`` reaches with its newest token, or None to go on."""
    params = request.sampling_params
    output = request.output_token_ids
    token = output[-1]
    num_output = len(output)
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None

"""A request body as the HTTP front's route takes it, for tests without a server: validated
by its pydantic model (runtime/api/openai/bodies.py), or refused with the 400 that the front
answers (runtime/api/openai_errors.validation_error)."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from runtime.api.openai.errors import validation_error


def validated(model: type[BaseModel], body: dict):
    """`body` as `model`, or the front's HttpError (400) for it."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None

"""Which tests of a module this pytest session runs: module fixtures that start slow work ahead
(stacks, child processes, builds) start only what a selected test will use."""

from __future__ import annotations


def selected_names(request) -> set[str]:
    """The (unparametrised) names of the selected tests in the requesting module."""
    return {getattr(item, "originalname", None) for item in request.session.items if item.module is request.module}


def selected_params(request, test_name: str) -> list[dict]:
    """The parameters of the selected items of ``test_name`` in the requesting module."""
    return [item.callspec.params for item in request.session.items
            if getattr(item, "originalname", None) == test_name and item.module is request.module and hasattr(item, "callspec")]

"""The incrementally encoded verify body equals json.dumps of the plain body."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.server.prompt_json import ContextTextCache, verify_body_text
from proxy.server.upstream import GREEDY_VERIFY_PARAMS

ids = st.lists(st.integers(0, 151_935), max_size=40)


def plain_body(context: list[int], draft: list[int]) -> dict:
    return {"prompt": [context + draft[:i] for i in range(len(draft) + 1)], **GREEDY_VERIFY_PARAMS}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(ids, ids), min_size=1, max_size=6))
def test_rounds_of_growing_and_rolled_back_contexts_encode_exactly(rounds):
    cache = ContextTextCache(size=3)
    context: list[int] = []
    for grow, draft in rounds:
        # grow the conversation, or roll it back and branch (a new conversation)
        context = context + grow if len(grow) % 3 else grow
        text = verify_body_text(cache.text(context), draft, GREEDY_VERIFY_PARAMS)
        assert json.loads(text) == plain_body(context, draft)


def test_context_text_is_extended_not_rebuilt():
    cache = ContextTextCache()
    first = list(range(100))
    cache.text(first)
    grown = [*first, 7, 8]
    assert cache.text(grown) == ",".join(map(str, grown))
    other = [5, 5, 5]  # another conversation keeps its own entry
    assert cache.text(other) == "5,5,5"
    assert cache.text([*grown, 9]).endswith(",7,8,9")


def test_empty_params_and_empty_context():
    assert json.loads(verify_body_text("", [3], {})) == {"prompt": [[], [3]]}

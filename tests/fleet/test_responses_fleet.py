"""A background response made through one web process and read through the other, as the
fleet's clients do (tests/fleet/conftest.py): its events, read from any sequence number
while it still generates, are exactly those after it, none lost and none repeated."""

from __future__ import annotations

import openai

from tests.fleet.conftest import Fleet
from tests.live import make_tenant_key

# An answer long whatever the weights say: still generating when the second read starts.
LONG = {"type": "json_schema", "name": "essay", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["essay"],
    "properties": {"essay": {"type": "string", "minLength": 300}}}}


def test_a_background_responses_events_read_from_the_other_web_process_mid_generation(
        fleet: Fleet, served_model: str):
    key = make_tenant_key("readers").key
    first, second = (openai.OpenAI(base_url=f"{web}/v1", api_key=key, max_retries=0,
                                   timeout=120) for web in fleet.webs)
    made = first.responses.create(model=served_model, input="Write an essay.",
                                  background=True, max_output_tokens=240,
                                  text={"format": LONG})
    seen = []
    for event in first.responses.retrieve(made.id, stream=True):
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) == 5:
            break
    after = seen[-1].sequence_number
    assert second.responses.retrieve(made.id).status == "in_progress"
    tail = list(second.responses.retrieve(made.id, stream=True, starting_after=after))
    assert tail[0].sequence_number == after + 1
    assert tail[-1].type in ("response.completed", "response.incomplete")
    whole = list(first.responses.retrieve(made.id, stream=True))
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[:len(seen)] == seen
    assert tail == whole[after + 1:]
    final = second.responses.retrieve(made.id)
    assert final.output_text == tail[-1].response.output_text

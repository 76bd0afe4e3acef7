"""The demo model's chat format: its Jinja chat template and the tool-call format it declares.

The template is stored in the demo model's tokenizer_config.json, where transformers and
the platform (core.served_models) both read it, and renders the demo model's training chats.
"""

from __future__ import annotations

# How the demo model writes tool calls (inference.tools.FORMATS), declared in
# tokenizer_config.json as "tool_parser" so no one has to guess it from the template.
TOOL_PARSER = "hermes"

# Roles are written as their special token, then a newline, the content and <|end|>.
# NOTE: a conversation of system, user and assistant messages with plain content, and no
# tools, renders byte for byte as it did before tools existed: the weights are trained on
# that format (tests/core/test_chat_template_tools.py keeps it so). The template has no
# whitespace outside its tags, so it renders alike with and without trim_blocks.
#
# With tools, in the Hermes format Qwen2.5 uses: a system turn (the conversation's own
# system message first, if it opens with one) lists them in <tools></tools>, one JSON per
# line; an assistant turn writes each call as <tool_call>{"name", "arguments"}</tool_call>;
# tool results go back in a user turn, one <tool_response> block each, consecutive tool
# messages in one turn, as Qwen2.5 does: the tokenizer has no tool role token, and adding
# one would change the vocabulary and so the weights.
_TOOLS_PROMPT = (
    "# Tools\\n\\nYou may call functions to help with the request. Their signatures are "
    "within <tools></tools> tags, one JSON object per line:\\n<tools>"
)
_CALL_PROMPT = (
    "\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and "
    "arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|end|>\\n'
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + _TOOLS_PROMPT + "' }}"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '" + _CALL_PROMPT + "' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('roles must be system, user, assistant or tool') }}"
    "{% elif tools and loop.first and message['role'] == 'system' %}"  # already in the tools turn
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|user|>' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|end|>\\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + call['name'] | tojson + ', \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"  # not a JSON object: as sent
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

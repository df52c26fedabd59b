"""Chat templates: rendering a checkpoint's own, and the shapes the built-in families ship.

A checkpoint's ``chat_template`` is jinja2 written for ``transformers``, which
renders it in a sandbox with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter and a ``raise_exception``
global; :func:`compile_template` builds the same environment so a template
renders here exactly as it does there (and in mlx-lm, which calls
``transformers``).

The constants are the built-in families' template *shapes*, as their real
checkpoints ship them in ``tokenizer_config.json``, trimmed of tool calling and
images; synthetic installs carry them so a chat prompt on a random-weight
model has the same structure (and the same tokens, in mlx-lm too) as on the
real one.
"""

from __future__ import annotations

import json

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_template(source: str) -> jinja2.Template:
    """*source* compiled in the environment ``transformers`` renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


# Gemma 4: every turn in ``<|turn>ROLE\n ... <turn|>\n`` (``assistant`` rendered as
# ``model``), a real ``system`` turn (Gemma 3 folded it into the first user turn),
# roles alternating after it, and ``<|turn>model\n`` as the generation prompt. With
# ``tools`` it writes Gemma 4's native tool syntax (Google's "Function calling with
# Gemma 4" guide): each tool as ``<|tool>declaration:NAME{description:...,
# parameters:{...}}<tool|>`` in the system turn, after its text; an assistant's
# ``tool_calls`` as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``; and ``tool``
# results as ``<|tool_response>response:NAME{value:...}<tool_response|>`` in a user
# turn; strings are wrapped in ``<|"|>``, keys are bare. (Where Google's template puts
# the tool responses, inside the model's turn or a turn of their own, is not settled
# by the sources read; the synthetic tokenizer keeps the tool markers as text.)
_GEMMA4_VALUE = (
    "{% macro g4(v) %}"
    "{% if v is none %}null"
    "{% elif v is sameas true %}true{% elif v is sameas false %}false"
    "{% elif v is string %}{{ '<|\"|>' + v + '<|\"|>' }}"
    "{% elif v is mapping %}{{ '{' }}"
    "{% for k, x in v.items() %}{{ k }}:{{ g4(x) }}{% if not loop.last %},{% endif %}"
    "{% endfor %}{{ '}' }}"
    "{% elif v is iterable %}["
    "{% for x in v %}{{ g4(x) }}{% if not loop.last %},{% endif %}{% endfor %}]"
    "{% else %}{{ v | tojson }}{% endif %}"
    "{% endmacro %}"
)
GEMMA_CHAT_TEMPLATE = (
    _GEMMA4_VALUE + "{{ bos_token }}"
    "{% set system = messages[0]['content'] | trim if messages[0]['role'] == 'system' else '' %}"
    "{% set loop_messages = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% if system or tools %}{{ '<|turn>system\\n' + system }}"
    "{% for tool in tools or [] %}{% set fn = tool['function'] %}"
    "{{ '<|tool>declaration:' + fn['name'] + g4({'description': fn['description'] or '', "
    "'parameters': fn['parameters']}) + '<tool|>' }}"
    "{% endfor %}{{ '<turn|>\\n' }}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else "
    "('user' if message['role'] == 'tool' else message['role']) %}"
    "{% set before = loop_messages[loop.index0 - 1] if not loop.first else none %}"
    "{% set after = loop_messages[loop.index0 + 1] if not loop.last else none %}"
    "{% if message['role'] == 'tool' %}"
    "{% if before is none or before['role'] != 'tool' %}"
    "{{ '<|turn>user\\n' }}{% endif %}"
    "{% set ns2 = namespace(name='') %}"
    "{% for m in messages %}{% for c in (m['tool_calls'] or []) %}"
    "{% if c['id'] == message['tool_call_id'] %}{% set ns2.name = c['function']['name'] %}"
    "{% endif %}{% endfor %}{% endfor %}"
    "{{ '<|tool_response>response:' + ns2.name + g4({'value': message['content']}) }}"
    "{{ '<tool_response|>' }}"
    "{% if after is none or after['role'] != 'tool' %}{{ '<turn|>\\n' }}{% endif %}"
    "{% else %}"
    "{% if (role == 'user') == (before is not none and before['role'] != 'assistant') "
    "or (role == 'model' and before is none) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{{ message['content'] | trim }}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<|tool_call>call:' + call['function']['name'] + g4(call['function']['arguments']) }}"
    "{{ '<tool_call|>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<turn|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)

# Qwen3.5 (ChatML): no BOS, every turn in ``<|im_start|>role ... <|im_end|>``.
# Thinking, as the Qwen3.5 checkpoints' template: the generation prompt opens a
# ``<think>\n`` block the reply closes, unless ``enable_thinking=False`` pre-fills
# an empty one (``<think>\n\n</think>\n\n``); an assistant turn's reasoning is its
# ``reasoning_content``, else the text up to ``</think>`` of its content, and it is
# kept (re-rendered as ``<think>\nREASONING\n</think>\n\n``) only on the turns after
# the last user message (a tool loop's), dropped from earlier ones. With ``tools``,
# as the checkpoints' template: the system turn opens with the tools in ``<tools>``
# (one JSON object a line) and the XML call format's instructions, the system text
# after them; an assistant's ``tool_calls`` are rendered as
# ``<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>``
# blocks (a string V raw, a mapping or list as JSON, other scalars as ``str``), and
# consecutive ``tool`` results as ``<tool_response>`` blocks in one user turn.
QWEN_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:"
    "\\n\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following "
    "format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "<parameter=example_parameter_2>\\nThis is the value for the second parameter\\n"
    "that can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n"
    "<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags"
    "\\n- Required parameters MUST be specified\\n- You may provide optional reasoning for "
    "your function call in natural language BEFORE the function call, but NOT after\\n- If "
    "there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\\n</IMPORTANT>' }}"
    "{% if messages[0]['role'] == 'system' and messages[0]['content'] | trim %}"
    "{{ '\\n\\n' + messages[0]['content'] | trim }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% set skip_first = messages[0]['role'] == 'system' %}"
    "{% else %}{% set skip_first = false %}{% endif %}"
    "{% set ns = namespace(last_query=messages | length - 1, found=false) %}"
    "{% for message in messages[::-1] %}"
    "{% if not ns.found and message['role'] == 'user' %}"
    "{% set ns.found = true %}{% set ns.last_query = messages | length - 1 - loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if loop.first and skip_first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{% set content = message['content'] %}{% set reasoning = '' %}"
    "{% if message['role'] == 'assistant' %}"
    "{% if message['reasoning_content'] is string %}"
    "{% set reasoning = message['reasoning_content'] %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}{% endif %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' and loop.index0 > ns.last_query "
    "and (loop.last or reasoning | trim) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' + content }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + content }}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\\n<tool_call>\\n<function=' + fn['name'] + '>\\n' }}"
    "{% elif content | trim %}{{ '\\n\\n<tool_call>\\n<function=' + fn['name'] + '>\\n' }}"
    "{% else %}{{ '<tool_call>\\n<function=' + fn['name'] + '>\\n' }}{% endif %}"
    "{% if fn['arguments'] is mapping %}{% for key, value in fn['arguments'].items() %}"
    "{{ '<parameter=' + key + '>\\n' }}"
    "{% if value is mapping or (value is sequence and value is not string) %}"
    "{{ value | tojson }}{% else %}{{ value | string }}{% endif %}"
    "{{ '\\n</parameter>\\n' }}"
    "{% endfor %}{% endif %}"
    "{{ '</function>\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)

"""Chat templates of model families whose tokenizers are not among the fixtures, written for the
tests in the shape their real templates have where it matters here: how tools are shown, how
calls are written back, the turn markers (no downloads: see ../shared/fixtures/SOURCES.md)."""

from __future__ import annotations

# Qwen3: tools in the system turn, calls as <tool_call> JSON, the thinking in <think> tags; with
# enable_thinking false the prompt closes an empty thinking block. (The instructions around the
# tools are shorter than the real ones: stories260K's context is 512 tokens.)
QWEN3 = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\nCall as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# Mistral v11+ (Mistral Small 3.2, Magistral, Devstral): tools as JSON before the last user turn,
# each call as [TOOL_CALLS]name[ARGS]{...}.
MISTRAL_V11 = """{{- bos_token }}
{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' }}
{%- elif message.role == 'user' %}
{%- if tools and message == user_messages[-1] %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' %}
{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + call.function.arguments | tojson }}
{%- endfor %}
{{- eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

# Gemma 3: no system role (a system message opens the first user turn), the assistant is "model",
# and no tools at all: the template never reads them.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim }}
{{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\\n' }}
{%- endif -%}"""

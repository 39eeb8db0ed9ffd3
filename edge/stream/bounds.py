"""The bounds on what one request may ask the edge to do: every limit in one place.

This module owns the numbers. Request validation (`edge.api.request`,
`edge.stream.tools`) answers a request past one of them with a 400 naming the
limit and its value; the schema checks (`edge.stream.schema`) and the tool-text
scanners use the rest. Each limit is generous for real clients (OpenAI's own
limit where it has one) and small enough that the worst request still costs the
event loop only milliseconds. The request body itself is capped by
`[server] max_body_bytes`. It knows nothing else.
"""

from __future__ import annotations

from typing import Final

# --- the request body's JSON, whatever the API --------------------------------------
#
# Checked where the body is decoded (`edge.api.body.decode_object`), before any
# field is read: every free-form value a node receives (content parts, documents,
# tool results, schemas, response_format, chat_template_kwargs, ...) is inside it,
# so each is bounded by these two, and every later walk over it (its JSON for the
# node, the RunRequest) is shallow and linear.

# Nesting depth of the body's objects and arrays (the body itself is 1). A tool's
# schema (MAX_SCHEMA_DEPTH) sits a few levels down and fits with room to spare.
MAX_JSON_DEPTH: Final = 64
# Values in the body: array elements and object members, at every depth. 16,384
# messages of a dozen values each fit; a body of hundreds of thousands of tiny
# values (work per value for every step after the parse) does not.
MAX_JSON_VALUES: Final = 524_288

# --- the request -----------------------------------------------------------------

# Messages in one request: agents replay long histories, so far above 2048.
MAX_MESSAGES: Final = 16_384
# Content parts in one message (OpenAI accepts up to 500 images per request).
MAX_CONTENT_PARTS: Final = 1_024
# Tool calls in one assistant message of the history.
MAX_MESSAGE_TOOL_CALLS: Final = 1_024
# Characters of one history tool call's `arguments` string.
MAX_TOOL_ARGUMENTS_CHARS: Final = 1_048_576
# Declared tools (OpenAI's limit).
MAX_TOOLS: Final = 128
# Stop sequences (OpenAI's limit), and characters in each.
MAX_STOP: Final = 4
MAX_STOP_CHARS: Final = 1_024
# Metadata (OpenAI's limits): keys, characters per key, characters per value.
MAX_METADATA_KEYS: Final = 16
MAX_METADATA_KEY_CHARS: Final = 64
MAX_METADATA_VALUE_CHARS: Final = 512
# Characters of `model` and of `user`.
MAX_MODEL_CHARS: Final = 256
MAX_USER_CHARS: Final = 1_024
# Entries of `logit_bias` (a vocabulary-sized map would be pointless anyway).
MAX_LOGIT_BIAS: Final = 1_024

# --- JSON Schemas a caller sends (tool parameters, response_format) ---------------

# Serialized (compact JSON, UTF-8) bytes of one schema.
MAX_SCHEMA_BYTES: Final = 32_768
# Serialized bytes of all the schemas of one request together.
MAX_REQUEST_SCHEMA_BYTES: Final = 262_144
# JSON nesting depth of one schema (objects and arrays; the root object is 1).
MAX_SCHEMA_DEPTH: Final = 32
# RE2 program size of one `pattern` / `patternProperties` regex: matching costs
# at most (text length x program size), so this bounds each match.
MAX_PATTERN_PROGRAM: Final = 1_000
# Schema keyword evaluations (plus one per 512 characters a pattern scans) allowed
# when validating the tool calls of one answer, or one strict output, against
# their schemas. A step costs 5 us typically and ~45 us at worst (a wide anyOf),
# so this bounds the validation at the end of a run to ~10 ms typically, ~90 ms
# at worst; 2,000 steps validate e.g. 300 objects of 3 fields.
MAX_VALIDATION_STEPS: Final = 2_000

# --- tool calls written as text in an answer ----------------------------------------
#
# A model can be prompted to write text that looks like the start of tool-call
# markup over and over (lines of `{`, fences, tags in prose). Each such candidate
# costs the scanners a few microseconds of Python, so an answer may spend only a
# budget on candidates that turn out not to be calls; past it, the rest of the
# answer is plain content (shown as it comes, never searched for calls). Real
# answers write their calls as one or a few blocks, after little else that looks
# like markup. The budget counts the same in the streaming filter and in the
# parse at the end, so what the stream shows never contains markup the parse
# hides.

# Characters a bare JSON or fenced candidate may span before it is resolved: a
# candidate still open past it is content, and so is the rest of the answer (the
# stream has shown it). Also what the streaming filter holds at most.
MAX_TOOL_CANDIDATE_CHARS: Final = 65_536
# The budget, in characters, of the candidates of one answer that are not calls:
# each costs TOOL_CANDIDATE_COST plus the characters the JSON decoder read before
# it failed (at most MAX_TOOL_CANDIDATE_CHARS). So at most 512 such candidates
# (a line-start `{`/`[` that is no call, a tag in prose, a code fence), a few
# ms of Python (5-10 us each), or 2 candidates decoded whole at C speed.
MAX_TOOL_CANDIDATE_WORK: Final = 131_072
TOOL_CANDIDATE_COST: Final = 256
# Tool calls (and failed call blocks) found as text in one answer: past it the
# answer fails with a tool_validation_error naming the limit.
MAX_TEXT_TOOL_CALLS: Final = 1_024

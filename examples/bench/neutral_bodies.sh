# The neutral upstream's answers, sourced by run.sh, profile.sh and
# instructions.sh: a static chat completion (NEUTRAL_PLAIN) and a static
# 16-chunk SSE stream (NEUTRAL_SSE: a role chunk, 16 content chunks, a finish
# chunk and `[DONE]`), each served by nginx `return 200`; and the same answer
# and stream as Anthropic's Messages API (A_PLAIN, A_SSE) and the Responses API
# (R_PLAIN, R_SSE) send them, for the pass-through rows.
neutral_chunk() { printf 'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"up","choices":[{"index":0,"delta":%s,"finish_reason":%s}]}\n\n' "$1" "$2"; }
NEUTRAL_PLAIN='{"id":"x1","object":"chat.completion","created":1,"model":"up","choices":[{"index":0,"message":{"role":"assistant","content":"hello there, this is a short answer"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":8,"total_tokens":13}}'
NEUTRAL_SSE=$({ neutral_chunk '{"role":"assistant","content":""}' null
  for i in $(seq 1 16); do neutral_chunk "{\"content\":\"tok$i \"}" null; done
  neutral_chunk '{}' '"stop"'; printf 'data: [DONE]\n\n'; }; printf '\n')
# The same answer as Anthropic sends it, for the Messages pass-through.
A_PLAIN='{"id":"msg_1","type":"message","role":"assistant","model":"up","content":[{"type":"text","text":"hello there, this is a short answer"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":8}}'
a_event() { printf 'event: %s\ndata: %s\n\n' "$1" "$2"; }
A_SSE=$({ a_event message_start '{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"up","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":1}}}'
  a_event content_block_start '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
  for i in $(seq 1 16); do a_event content_block_delta "{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok$i \"}}"; done
  a_event content_block_stop '{"type":"content_block_stop","index":0}'
  a_event message_delta '{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":16}}'
  a_event message_stop '{"type":"message_stop"}'; }; printf '\n')
# And as the Responses API sends it, for the Responses pass-through.
R_OBJ='"object":"response","created_at":1,"model":"up","error":null,"incomplete_details":null'
R_MSG='{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"hello there, this is a short answer","annotations":[]}]}'
R_USAGE='"usage":{"input_tokens":5,"output_tokens":8,"total_tokens":13}'
R_PLAIN="{\"id\":\"resp_1\",$R_OBJ,\"status\":\"completed\",\"output\":[$R_MSG],$R_USAGE}"
r_event() { printf 'event: %s\ndata: {"type":"%s","sequence_number":%s,%s}\n\n' "$1" "$1" "$2" "$3"; }
R_SSE=$({ r_event response.created 0 "\"response\":{\"id\":\"resp_1\",$R_OBJ,\"status\":\"in_progress\",\"output\":[]}"
  r_event response.output_item.added 1 '"output_index":0,"item":{"type":"message","id":"msg_1","status":"in_progress","role":"assistant","content":[]}'
  for i in $(seq 1 16); do r_event response.output_text.delta $((i + 1)) "\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"tok$i \""; done
  r_event response.output_item.done 18 "\"output_index\":0,\"item\":$R_MSG"
  r_event response.completed 19 "\"response\":{\"id\":\"resp_1\",$R_OBJ,\"status\":\"completed\",\"output\":[$R_MSG],$R_USAGE}"; }; printf '\n')

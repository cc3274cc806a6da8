# The neutral upstream's answers, sourced by run.sh, profile.sh and
# instructions.sh: a static chat completion (NEUTRAL_PLAIN) and a static
# 16-chunk SSE stream (NEUTRAL_SSE: a role chunk, 16 content chunks, a finish
# chunk and `[DONE]`), each served by nginx `return 200`.
neutral_chunk() { printf 'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"up","choices":[{"index":0,"delta":%s,"finish_reason":%s}]}\n\n' "$1" "$2"; }
NEUTRAL_PLAIN='{"id":"x1","object":"chat.completion","created":1,"model":"up","choices":[{"index":0,"message":{"role":"assistant","content":"hello there, this is a short answer"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":8,"total_tokens":13}}'
NEUTRAL_SSE=$({ neutral_chunk '{"role":"assistant","content":""}' null
  for i in $(seq 1 16); do neutral_chunk "{\"content\":\"tok$i \"}" null; done
  neutral_chunk '{}' '"stop"'; printf 'data: [DONE]\n\n'; }; printf '\n')

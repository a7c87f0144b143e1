#!/usr/bin/env bash
# Runs one request per dialect against a live gateway and prints headers + bodies.
#   BASE=http://127.0.0.1:8000 KEY=sk-aigw-... MODEL=SmolLM2-135M-Instruct.Q4_1 docs/reference/api-examples/dialects.sh
set -u
: "${BASE:?}" "${KEY:?}" "${MODEL:?}"
post() {  # post PATH JSON [extra curl args...]
  local path=$1 body=$2; shift 2
  echo "### POST $path"
  curl -sS -N -D - "$BASE$path" -H "Authorization: Bearer $KEY" \
       -H 'content-type: application/json' -d "$body" "$@"
  echo
}
post /v1/chat/completions "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}],\"max_tokens\":8,\"temperature\":0}"
post /v1/chat/completions "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}],\"max_tokens\":4,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}"
post /v1/completions "{\"model\":\"$MODEL\",\"prompt\":\"The capital of France is\",\"max_tokens\":5,\"temperature\":0}"
post /v1/completions "{\"model\":\"$MODEL\",\"prompt\":\"The capital of France is\",\"max_tokens\":3,\"temperature\":0,\"stream\":true}"
post /v1/responses "{\"model\":\"$MODEL\",\"instructions\":\"Be brief.\",\"input\":\"Say hi\",\"max_output_tokens\":6,\"temperature\":0}"
post /v1/responses "{\"model\":\"$MODEL\",\"input\":\"Say hi\",\"max_output_tokens\":3,\"temperature\":0,\"stream\":true}"
post /v1/messages "{\"model\":\"$MODEL\",\"system\":\"Be brief.\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}],\"max_tokens\":6,\"temperature\":0}"
post /anthropic/v1/messages "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}],\"max_tokens\":3,\"temperature\":0,\"stream\":true}"

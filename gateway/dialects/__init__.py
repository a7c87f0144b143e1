"""Public API shapes, each translated once to and from gateway/request/canonical.py."""

from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.dialects.openai_chat import OpenAIChat
from gateway.dialects.openai_completions import OpenAICompletions
from gateway.dialects.openai_responses import OpenAIResponses

__all__ = ["AnthropicMessages", "Dialect", "OpenAIChat", "OpenAICompletions", "OpenAIResponses",
           "StreamEncoder"]

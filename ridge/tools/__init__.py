"""Tool calling: the formats models write tool calls in (``parsers``), and what a request's
``tools`` and ``tool_choice`` ask of the engine and of the answer (``calls``)."""

//! Gemini wire translation (in progress).

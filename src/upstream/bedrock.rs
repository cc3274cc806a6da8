//! Bedrock Converse wire translation (in progress).

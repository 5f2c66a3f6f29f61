"""The wire protocol every role speaks: the message catalogue (``messages.py``) and its codec to ZeroMQ
multipart frames and back (``codec.py``). Roles use it as one namespace: ``from common import protocol as P``."""

from common.protocol.codec import (DEFAULT_MAX_MESSAGE_BYTES, INLINE_ARRAY_BYTES, MAX_DEPTH, MAX_EMBED_DEPTH,
                                   MAX_NDIM, PROTOCOL_VERSION, RawMessage, decode, encode, encode_with_embedded,
                                   frame_buffer, frame_nbytes, frames_nbytes, peek_type)
from common.protocol.messages import (ALLOWED_DTYPES, CONTROL_TOPIC, MESSAGE_TYPES, Ack, Batch, BatchRequest, Commit,
                                      Control, EnvEvaluate, EnvEvaluation, EnvObservation, EnvReset, EnvStep, Error,
                                      Goodbye, Heartbeat, Hello, Holding, Leaving, Message, ProtocolError, Ready, Record,
                                      SessionClose, SessionClosed, SessionOpen, SessionOpened, SuccessBatch,
                                      SuccessRequest, SuccessSample, Ticket, TicketRequest, Trajectory, TrajectoryGroup,
                                      TurnView, WeightRound)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "INLINE_ARRAY_BYTES", "MAX_DEPTH", "MAX_EMBED_DEPTH", "MAX_NDIM",
           "PROTOCOL_VERSION", "RawMessage", "decode", "encode", "encode_with_embedded", "frame_buffer", "frame_nbytes",
           "frames_nbytes", "peek_type", "ALLOWED_DTYPES", "CONTROL_TOPIC", "MESSAGE_TYPES", "Ack", "Batch",
           "BatchRequest", "Commit", "Control", "EnvEvaluate", "EnvEvaluation", "EnvObservation", "EnvReset", "EnvStep",
           "Error", "Goodbye", "Leaving", "Heartbeat", "Hello", "Holding", "Message", "ProtocolError", "Ready", "Record",
           "SessionClose", "SessionClosed", "SessionOpen", "SessionOpened", "SuccessBatch", "SuccessRequest",
           "SuccessSample", "Ticket", "TicketRequest", "Trajectory", "TrajectoryGroup", "TurnView", "WeightRound"]

//! API errors and the one place they become gRPC status codes.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("`model` is required")]
    MissingModel,
    #[error("one of {0} is required")]
    MissingInput(&'static str),
    #[error("{0}")]
    Unimplemented(&'static str),
    #[error("invalid `{field}`: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let code = match &e {
            ApiError::MissingModel
            | ApiError::MissingInput(_)
            | ApiError::InvalidArgument { .. } => Code::InvalidArgument,
            ApiError::Unimplemented(_) => Code::Unimplemented,
        };
        Status::new(code, e.to_string())
    }
}

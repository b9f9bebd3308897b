//! HTTP routes, kept thin: read and check the body, hand the request to `chat`/`completions` for validation,
//! queue it on the engine, and stream or collect the answer.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Path, Query, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::chat::{self, ChatResponder};
use crate::completions::{self, CompletionResponder};
use crate::engine::{EngineShared, Event, Job, SequenceSpec, SubmitError};
use crate::error::{parse_json, parse_json_with_sampling, ApiError};
use crate::params;
use crate::response_store::{Background, EventLog, StoredResponse};
use crate::responses::{self, ResponsesResponder};
use crate::server::{AppState, Ready};
use crate::types::*;
use tracing::Instrument;

type AppStateRef = Arc<AppState>;

pub fn router(state: AppStateRef) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(text_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(get_response).delete(delete_response))
        .route("/v1/responses/{id}/input_items", get(list_input_items))
        .route("/v1/responses/{id}/cancel", post(cancel_response))
        .route("/v1/conversations", post(create_conversation))
        .route(
            "/v1/conversations/{id}",
            get(get_conversation)
                .post(update_conversation)
                .delete(delete_conversation),
        )
        .route(
            "/v1/conversations/{id}/items",
            get(list_conversation_items).post(add_conversation_items),
        )
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            get(get_conversation_item).delete(delete_conversation_item),
        )
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(cors(&state.config.allowed_origins))
        .with_state(state)
}

/// Cross-origin requests from the `--allowed-origins` (none by default, `*` for any), with preflight `OPTIONS`
/// answered; browsers refuse other origins' requests that need a preflight (JSON bodies, `Authorization`).
fn cors(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let allow_origin = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    CorsLayer::new()
        .allow_origin(allow_origin)
        .allow_methods([Method::GET, Method::POST, Method::DELETE])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, REQUEST_ID])
        .expose_headers([REQUEST_ID, header::RETRY_AFTER])
        .max_age(std::time::Duration::from_secs(3600))
}

/// Counts the request in the metrics, and gives it an id: the client's `x-request-id` when it sends a usable one
/// (up to 128 visible ASCII characters), a new one otherwise. The id is echoed in the response's `x-request-id`
/// and names the request in the logs.
async fn count_requests(State(state): State<AppStateRef>, request: Request, next: Next) -> Response {
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let id = request
        .headers()
        .get(REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.as_bytes().iter().all(|b| b.is_ascii_graphic()))
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_str(&params::random_id("req-")).expect("letters and digits"));
    let span = tracing::info_span!("request", id = %id.to_str().unwrap_or_default(), endpoint = %endpoint);
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status().as_u16();
    span.in_scope(|| {
        if status >= 500 {
            tracing::warn!(status, "answered");
        } else {
            tracing::debug!(status, "answered");
        }
    });
    state.metrics.request(&endpoint, status);
    response.headers_mut().insert(REQUEST_ID, id);
    response
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

async fn require_api_key(State(state): State<AppStateRef>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        // The scheme's name is case-insensitive (RFC 7235); the key is compared without surrounding spaces.
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim_start().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim());
        if !given.is_some_and(|given| constant_time_eq(given.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> ApiError {
    ApiError::not_found("No such endpoint. This server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize, POST /detokenize, GET /health and GET /metrics.")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "This endpoint does not take this HTTP method.",
    )
    .with_code("method_not_allowed")
}

async fn health(State(state): State<AppStateRef>) -> Response {
    if state.engine.shared.queue.has_failed() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "failed"}))).into_response();
    }
    if state.shutting_down.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response();
    }
    match state.ready.get() {
        Some(ready) => (
            StatusCode::OK,
            Json(json!({
                "status": "ok",
                "device": ready.backend_name,
                "max_seqs": ready.max_seqs,
                "kv_tokens": ready.kv_tokens,
                "context": ready.context,
                "max_prefill_tokens": ready.max_prefill_tokens,
                "prefix_cache": ready.prefix_cache,
            })),
        )
            .into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response(),
    }
}

async fn metrics(State(state): State<AppStateRef>) -> Response {
    if let Some(ready) = state.ready.get() {
        let bytes = ready.tokenizer.segment_cache_bytes();
        state.metrics.segment_cache_bytes.set(bytes as f64);
        let bytes = ready.tokenizer.word_cache_bytes();
        state.metrics.word_cache_bytes.set(bytes as f64);
    }
    let (stored, bytes) = state.responses.usage();
    state.metrics.responses_stored.set(stored as f64);
    state.metrics.response_store_bytes.set(bytes as f64);
    let (kept, bytes) = state.conversations.usage();
    state.metrics.conversations.set(kept as f64);
    state.metrics.conversation_store_bytes.set(bytes as f64);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.config.model_id.clone(),
        object: "model",
        created: state.created,
        owned_by: "lily",
        root: state.config.model_dir.display().to_string(),
        parent: None,
        max_model_len: state.ready.get().map_or(0, |r| r.context),
    }
}

async fn list_models(State(state): State<AppStateRef>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&state)],
    })
}

async fn get_model(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ModelCard>, ApiError> {
    // An id that is not UTF-8 once its percent escapes are decoded names no model either.
    let Ok(Path(id)) = id else {
        return Err(ApiError::model_not_found(
            "(an id that is not UTF-8)",
            &state.config.model_id,
        ));
    };
    if id != state.config.model_id {
        return Err(ApiError::model_not_found(&id, &state.config.model_id));
    }
    Ok(Json(model_card(&state)))
}

/// JSON routes take only JSON bodies (415 otherwise): a web page can send a `text/plain` POST to a local server
/// without asking the browser first, but not an `application/json` one.
fn check_json_content_type(request: &Request) -> Result<(), ApiError> {
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(ApiError::unsupported_media_type(content_type))
}

/// Reads the request's body, which must be JSON (415 otherwise), arrive within `--body-timeout` (408 otherwise) and be at most
/// `--max-body-bytes` long (413 otherwise).
async fn read_body(request: Request, state: &AppStateRef) -> Result<Bytes, ApiError> {
    check_json_content_type(&request)?;
    let body = tokio::time::timeout(state.config.body_timeout, Bytes::from_request(request, state))
        .await
        .map_err(|_| ApiError::body_timeout(state.config.body_timeout))?;
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(state.config.max_body_bytes)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {rejection}"))
        }
    })
}

fn ready(state: &AppState) -> Result<&Ready, ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    state.ready.get().ok_or_else(ApiError::loading)
}

/// Refuses at once when the queue is full, before the work of rendering and tokenizing the prompt (the send to
/// the queue is the check that counts; this one keeps an overloaded server cheap to refuse).
fn check_queue(state: &AppState) -> Result<(), ApiError> {
    let shared = state.shared();
    if shared.queue.is_full() {
        shared.metrics.rejected.increment(1);
        return Err(ApiError::queue_full(state.config.max_queue));
    }
    Ok(())
}

fn check_model(model: Option<&str>, state: &AppState) -> Result<(), ApiError> {
    match model {
        None | Some("") => Ok(()),
        Some(m) if m == state.config.model_id => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m, &state.config.model_id)),
    }
}

/// A generation request counted in flight from the moment its handler starts until its response is done or
/// abandoned (dropped with the handler's future or the response stream), so that shutdown waits for requests still
/// being read, rendered or tokenized too.
struct InFlight(Arc<EngineShared>);

impl InFlight {
    /// Counts a request in; refused once shutdown has begun. Shutdown sets its flag before it reads the count, and
    /// this reads the flag after counting, so either shutdown waits for this request or the request is refused.
    fn enter(state: &AppState) -> Result<InFlight, ApiError> {
        let shared = state.engine.shared.clone();
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        let counted = InFlight(shared);
        if state.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        Ok(counted)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Cancels the job when dropped, with the response stream (client gone) or the handler's future: sets its cancel
/// flag (a running job stops within a step) and takes it out of the queue if it is still waiting there. The
/// request leaves the in-flight count after that.
struct CancelOnDrop {
    cancel: Arc<AtomicBool>,
    id: u64,
    counted: InFlight,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        self.counted.0.queue.withdraw(self.id);
    }
}

fn submit(
    state: &AppState,
    counted: InFlight,
    sequences: Vec<SequenceSpec>,
    arrived: Instant,
) -> Result<(UnboundedReceiver<Event>, CancelOnDrop), ApiError> {
    let (events, receiver) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        sequences,
        events,
        cancel: cancel.clone(),
        arrived,
    };
    // A request prepared while shutdown began is refused rather than queued behind the last requests.
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    match state.engine.submit(job) {
        Ok(id) => Ok((receiver, CancelOnDrop { cancel, id, counted })),
        Err(SubmitError::QueueFull) => Err(ApiError::queue_full(state.config.max_queue)),
        Err(SubmitError::EngineGone) if counted.0.queue.has_failed() => Err(ApiError::engine_failed()),
        Err(SubmitError::EngineGone) => Err(ApiError::shutting_down()),
    }
}

/// One server-sent event: its `data:` payload, and the `event:` name it carries where the endpoint names its events
/// (the Responses API names each by its `type`, as OpenAI's server does; chat and completions send data only).
#[derive(Clone)]
pub struct SseData {
    pub event: Option<&'static str>,
    pub data: String,
}

impl SseData {
    /// A `data:` line without an event name.
    pub fn data(data: String) -> SseData {
        SseData { event: None, data }
    }
}

/// One server-sent event, named where it has a name.
fn sse_event(d: SseData) -> Result<SseEvent, Infallible> {
    let event = SseEvent::default().data(d.data);
    Ok(match d.event {
        Some(name) => event.event(name),
        None => event,
    })
}

/// Server-sent events: each engine event becomes zero or more events; chat and completion streams end with `[DONE]`.
fn sse_response<F>(receiver: UnboundedReceiver<Event>, guard: CancelOnDrop, on_event: F) -> Response
where
    F: FnMut(Event) -> (Vec<SseData>, bool) + Send + 'static,
{
    let stream = futures_util::stream::unfold(Some((receiver, guard, on_event)), |state| async move {
        let (mut receiver, guard, mut on_event) = state?;
        loop {
            match receiver.recv().await {
                Some(event) => {
                    let (data, done) = on_event(event);
                    if done {
                        return Some((data, None));
                    }
                    if !data.is_empty() {
                        return Some((data, Some((receiver, guard, on_event))));
                    }
                }
                None => {
                    let error = ApiError::internal("the engine stopped before finishing the request");
                    let data = vec![chat::to_json(&error.body()), "[DONE]".into()];
                    return Some((data.into_iter().map(SseData::data).collect(), None));
                }
            }
        }
    })
    .flat_map(|data| futures_util::stream::iter(data.into_iter().map(sse_event)));
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

async fn collect<T, F>(
    mut receiver: UnboundedReceiver<Event>,
    _guard: CancelOnDrop,
    mut on_event: F,
) -> Result<T, ApiError>
where
    F: FnMut(Event) -> Option<Result<T, ApiError>>,
{
    while let Some(event) = receiver.recv().await {
        if let Some(result) = on_event(event) {
            return result;
        }
    }
    Err(ApiError::internal("the engine stopped before finishing the request"))
}

/// Runs the CPU-heavy part of a request (parsing a large body, rendering the chat template, tokenizing) on
/// tokio's blocking pool, at most one request per core at a time, so that the async threads stay free to answer
/// `/health` and to feed running streams whatever clients send.
async fn off_runtime<T, F>(state: &AppStateRef, work: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
{
    let permit = state
        .prepare_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::shutting_down())?;
    let state = state.clone();
    let queued = Instant::now();
    // The work's log lines name the request, as the handler's do.
    let span = tracing::Span::current();
    let (result, started, finished) = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let _span = span.enter();
        let started = Instant::now();
        let result = work(&state);
        (result, started, Instant::now())
    })
    .await
    .unwrap_or_else(|_| {
        let now = Instant::now();
        (Err(ApiError::internal("preparing the request failed")), now, now)
    });
    // The hand-offs between the async threads and the blocking pool, which a request pays before its prefill.
    tracing::debug!(
        to_pool_ms = (started - queued).as_secs_f64() * 1e3,
        work_ms = (finished - started).as_secs_f64() * 1e3,
        back_ms = finished.elapsed().as_secs_f64() * 1e3,
        "work done off the async threads"
    );
    result
}

/// What the two completion endpoints hand to [`complete`]: the sequences to queue, whether to stream, and the
/// responder that turns the engine's events into the endpoint's response or chunks.
struct Prepared<R> {
    stream: bool,
    sequences: Vec<SequenceSpec>,
    responder: R,
}

/// Turns engine events into a completion endpoint's answer; [`ChatResponder`] and [`CompletionResponder`].
trait Responder: Send + 'static {
    type Response: serde::Serialize;
    /// Streaming: the server-sent events an engine event produces, and whether the stream ends.
    fn stream_event(&mut self, event: Event) -> (Vec<SseData>, bool);
    /// Not streaming: `Some` once the response is complete (or failed).
    fn collect_event(&mut self, event: Event) -> Option<Result<Self::Response, ApiError>>;
    /// Once the response is complete: the reply a client will send back in its next request, if any, whose
    /// tokenizing can be done now, while the client reads the answer.
    fn take_reply(&mut self) -> Option<String> {
        None
    }
    /// A request to run in the background: its answer now, and what its task holds while it runs
    /// ([`run_background`]), or why it cannot run there. `None` for the others.
    fn accept_background(&mut self) -> Option<Result<(Self::Response, Background), ApiError>> {
        None
    }
    /// The background request was cancelled; the events that end a streamed one's stream.
    fn cancelled(&mut self) -> Vec<SseData> {
        Vec::new()
    }
}

impl Responder for ChatResponder {
    type Response = ChatCompletion;
    fn stream_event(&mut self, event: Event) -> (Vec<SseData>, bool) {
        let (data, done) = ChatResponder::stream_event(self, event);
        (data.into_iter().map(SseData::data).collect(), done)
    }
    fn collect_event(&mut self, event: Event) -> Option<Result<ChatCompletion, ApiError>> {
        ChatResponder::collect_event(self, event)
    }
    fn take_reply(&mut self) -> Option<String> {
        self.reply.take()
    }
}

impl Responder for ResponsesResponder {
    type Response = ResponseObject;
    fn stream_event(&mut self, event: Event) -> (Vec<SseData>, bool) {
        ResponsesResponder::stream_event(self, event)
    }
    fn collect_event(&mut self, event: Event) -> Option<Result<ResponseObject, ApiError>> {
        ResponsesResponder::collect_event(self, event)
    }
    fn take_reply(&mut self) -> Option<String> {
        ResponsesResponder::take_reply(self)
    }
    fn accept_background(&mut self) -> Option<Result<(ResponseObject, Background), ApiError>> {
        ResponsesResponder::accept_background(self)
    }
    fn cancelled(&mut self) -> Vec<SseData> {
        ResponsesResponder::cancelled(self)
    }
}

impl Responder for CompletionResponder {
    type Response = Completion;
    fn stream_event(&mut self, event: Event) -> (Vec<SseData>, bool) {
        let (data, done) = CompletionResponder::stream_event(self, event);
        (data.into_iter().map(SseData::data).collect(), done)
    }
    fn collect_event(&mut self, event: Event) -> Option<Result<Completion, ApiError>> {
        CompletionResponder::collect_event(self, event)
    }
}

/// Tokenizes `reply` as the next request of the conversation will hold it, on a blocking thread, so that the
/// segment cache has it by then (see [`chat::warm_reply`]).
fn warm_reply(state: &AppStateRef, reply: Option<String>) {
    let Some(reply) = reply else { return };
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        if let Some(ready) = state.ready.get() {
            chat::warm_reply(ready, reply);
        }
    });
}

/// The one handler behind both completion endpoints: read the body, prepare the request off the async threads
/// (`prepare`: parse, check, render and tokenize, build the responder), queue it, then stream or collect.
async fn complete<R, F>(state: AppStateRef, request: Request, prepare: F) -> Response
where
    R: Responder,
    F: FnOnce(&[u8], &AppState) -> Result<Prepared<R>, ApiError> + Send + 'static,
{
    let arrived = Instant::now();
    let result = async {
        let counted = InFlight::enter(&state)?;
        let body = read_body(request, &state).await?;
        let read_ms = arrived.elapsed().as_secs_f64() * 1e3;
        let body_bytes = body.len();
        let Prepared {
            stream,
            sequences,
            mut responder,
        } = off_runtime(&state, move |state| prepare(&body, state)).await?;
        tracing::debug!(
            prepared_ms = arrived.elapsed().as_secs_f64() * 1e3,
            read_ms,
            body_bytes,
            prompt_tokens = sequences.first().map_or(0, |s| s.prompt.len()),
            "request read, rendered and tokenized"
        );
        let (receiver, guard) = submit(&state, counted, sequences, arrived)?;
        if let Some(accepted) = responder.accept_background() {
            // Where it is refused, `?` returns the error and dropping `guard` cancels the job just submitted.
            let (accepted, background) = accepted?;
            let span = tracing::Span::current();
            let events = background.events.clone();
            tokio::spawn(run_background(receiver, guard, responder, background).instrument(span));
            // A streamed one answers with its events as they come; its client may leave and read them again.
            return Ok(match events {
                Some(events) => event_log_response(events, 0),
                None => Json(accepted).into_response(),
            });
        }
        if stream {
            let span = tracing::Span::current();
            let mut first = true;
            let state = state.clone();
            Ok(sse_response(receiver, guard, move |event| {
                let (data, done) = responder.stream_event(event);
                if done {
                    warm_reply(&state, responder.take_reply());
                }
                if first && !data.is_empty() {
                    first = false;
                    span.in_scope(|| {
                        tracing::debug!(
                            since_arrival_ms = arrived.elapsed().as_secs_f64() * 1e3,
                            "first chunk streamed"
                        )
                    });
                }
                (data, done)
            }))
        } else {
            let completion = collect(receiver, guard, |event| responder.collect_event(event)).await?;
            warm_reply(&state, responder.take_reply());
            Ok(Json(completion).into_response())
        }
    };
    result.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// Runs a background request to its end, whose responder keeps it (or its failure) in the response store, or
/// until it is cancelled: then the job is cancelled and the response kept as `cancelled`. A streamed one's events
/// go to its log as they come (which ends when this does). The request stays in flight until then, so a graceful
/// shutdown waits for it as for any other.
async fn run_background<R: Responder>(
    mut receiver: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    mut responder: R,
    background: Background,
) {
    let cancel = background.cancel.clone();
    loop {
        tokio::select! {
            event = receiver.recv() => {
                let event = event.unwrap_or_else(|| {
                    Event::Error(ApiError::internal("the engine stopped before finishing the request"))
                });
                let done = match &background.events {
                    Some(events) => {
                        let (data, done) = responder.stream_event(event);
                        events.push(data);
                        done
                    }
                    None => responder.collect_event(event).is_some(),
                };
                if done {
                    break;
                }
            }
            _ = cancel.notified() => {
                tracing::debug!("background response cancelled");
                drop(guard);
                let data = responder.cancelled();
                if let Some(events) = &background.events {
                    events.push(data);
                }
                return;
            }
        }
    }
    drop(guard);
    drop(background);
}

async fn chat_completions(State(state): State<AppStateRef>, request: Request) -> Response {
    complete(state, request, |body, state| {
        let started = Instant::now();
        let (request, sampling): (ChatCompletionRequest, _) = parse_json_with_sampling(body)?;
        let parsed = started.elapsed();
        check_model(request.model.as_deref(), state)?;
        let ready = ready(state)?;
        check_queue(state)?;
        let plan = chat::prepare(request, sampling, ready)?;
        tracing::debug!(
            parse_ms = parsed.as_secs_f64() * 1e3,
            prepare_ms = (started.elapsed() - parsed).as_secs_f64() * 1e3,
            "chat request parsed and prepared"
        );
        let responder = ChatResponder::new(
            &plan,
            state.config.model_id.clone(),
            ready.tokenizer.clone(),
            state.config.reasoning_field,
        );
        Ok(Prepared {
            stream: plan.stream,
            sequences: plan.sequences,
            responder,
        })
    })
    .await
}

async fn text_completions(State(state): State<AppStateRef>, request: Request) -> Response {
    complete(state, request, |body, state| {
        let started = Instant::now();
        let (request, sampling): (CompletionRequest, _) = parse_json_with_sampling(body)?;
        let parsed = started.elapsed();
        check_model(request.model.as_deref(), state)?;
        let ready = ready(state)?;
        check_queue(state)?;
        let plan = completions::prepare(request, sampling, ready)?;
        tracing::debug!(
            parse_ms = parsed.as_secs_f64() * 1e3,
            prepare_ms = (started.elapsed() - parsed).as_secs_f64() * 1e3,
            "completion request parsed and prepared"
        );
        let responder = CompletionResponder::new(&plan, state.config.model_id.clone(), ready.tokenizer.clone());
        Ok(Prepared {
            stream: plan.stream,
            sequences: plan.sequences,
            responder,
        })
    })
    .await
}

async fn responses(State(state): State<AppStateRef>, request: Request) -> Response {
    complete(state, request, |body, state| {
        let (request, sampling): (ResponsesRequest, _) = parse_json_with_sampling(body)?;
        check_model(request.model.as_deref(), state)?;
        let ready = ready(state)?;
        check_queue(state)?;
        let model = state.config.model_id.clone();
        let translated = responses::translate(request, &sampling, model, &state.responses, &state.conversations)?;
        let plan = chat::prepare(translated.chat, sampling, ready).map_err(responses::responses_param)?;
        let responder = ResponsesResponder::new(&plan, translated.template, ready.tokenizer.clone(), translated.kept);
        Ok(Prepared {
            stream: plan.stream,
            sequences: plan.sequences,
            responder,
        })
    })
    .await
}

/// A query string that does not parse: 400 with what is wrong.
fn bad_query(rejection: QueryRejection) -> ApiError {
    ApiError::bad_request(format!("invalid query: {}", rejection.body_text()))
}

/// The kept response that the path names, or 404.
fn stored_response(state: &AppState, id: Result<Path<String>, PathRejection>) -> Result<Arc<StoredResponse>, ApiError> {
    let id = path_id(id);
    state.responses.get(&id).ok_or_else(|| responses::not_found(&id))
}

/// A kept response, or with `stream=true` a streamed background response's events from `starting_after` on
/// (following it while it runs).
async fn get_response(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
    query: Result<Query<RetrieveQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    // A response deleted while it runs is gone here, though its task has not yet stopped.
    let response = stored_response(&state, id)?;
    if query.stream != Some(true) {
        if query.starting_after.is_some() {
            return Err(ApiError::invalid(
                "starting_after",
                "`starting_after` goes with `stream=true`",
            ));
        }
        return Ok(Json(response.response.clone()).into_response());
    }
    let Some(events) = state.responses.events(&response.response.id) else {
        return Err(ApiError::invalid(
            "stream",
            "only a response created with `background` and `stream` can be streamed again",
        ));
    };
    let from = query.starting_after.map_or(0, |n| n.saturating_add(1));
    Ok(event_log_response(events, usize::try_from(from).unwrap_or(usize::MAX)))
}

/// Server-sent events of a streamed background response's log from event `from` on, following it until it ends.
/// A client that leaves stops only its own reading.
fn event_log_response(events: Arc<EventLog>, from: usize) -> Response {
    let stream = futures_util::stream::unfold(Some((events, from)), |state| async move {
        let (events, from) = state?;
        let data = events.read_from(from).await;
        if data.is_empty() {
            return None;
        }
        let next = from + data.len();
        Some((data, Some((events, next))))
    })
    .flat_map(|data| futures_util::stream::iter(data.into_iter().map(sse_event)));
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

async fn delete_response(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = path_id(id);
    if !state.responses.remove(&id) {
        return Err(responses::not_found(&id));
    }
    // A background response deleted while it runs stops (its end is not kept).
    state.responses.cancel_background(&id, std::time::Duration::ZERO).await;
    Ok(Json(json!({"id": id, "object": "response", "deleted": true})))
}

/// Cancels a background response that is still running and answers it as it stands then (`cancelled`, or how it
/// ended where it ended first); a background response that has ended is answered as it is.
async fn cancel_response(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ResponseObject>, ApiError> {
    let id = path_id(id);
    state.responses.cancel_background(&id, CANCEL_WAIT).await;
    let response = state.responses.get(&id).ok_or_else(|| responses::not_found(&id))?;
    if !response.response.background {
        return Err(ApiError::bad_request("only a `background` response can be cancelled"));
    }
    Ok(Json(response.response.clone()))
}

/// How long a cancel waits for its background response to stop (a step of the engine, normally).
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

async fn list_input_items(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
    query: Result<Query<InputItemsQuery>, QueryRejection>,
) -> Result<Json<ItemList>, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    let response = stored_response(&state, id)?;
    // A long conversation's items are copied off the async threads.
    off_runtime(&state, move |_| responses::items_page(&response.input_items(), &query))
        .await
        .map(Json)
}

// Conversations: the handlers read the path and body and hand them to the store (conversations.rs).

/// A path's ids; one that is not UTF-8 once its percent escapes are decoded names nothing (an empty id).
fn path_id(id: Result<Path<String>, PathRejection>) -> String {
    id.map_or_else(|_| String::new(), |Path(id)| id)
}

async fn conversation_body(request: Request, state: &AppStateRef) -> Result<ConversationRequest, ApiError> {
    parse_json(&read_body(request, state).await?)
}

async fn create_conversation(
    State(state): State<AppStateRef>,
    request: Request,
) -> Result<Json<ConversationObject>, ApiError> {
    let body = conversation_body(request, &state).await?;
    state.conversations.create(body.metadata, body.items).map(Json)
}

async fn get_conversation(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ConversationObject>, ApiError> {
    state.conversations.get(&path_id(id)).map(Json)
}

async fn update_conversation(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
    request: Request,
) -> Result<Json<ConversationObject>, ApiError> {
    let body = conversation_body(request, &state).await?;
    state.conversations.update(&path_id(id), body.metadata).map(Json)
}

async fn delete_conversation(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    state.conversations.delete(&path_id(id)).map(Json)
}

async fn list_conversation_items(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
    query: Result<Query<InputItemsQuery>, QueryRejection>,
) -> Result<Json<ItemList>, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    state.conversations.items_page(&path_id(id), &query).map(Json)
}

async fn add_conversation_items(
    State(state): State<AppStateRef>,
    id: Result<Path<String>, PathRejection>,
    request: Request,
) -> Result<Json<ItemList>, ApiError> {
    let body = conversation_body(request, &state).await?;
    state.conversations.add_items(&path_id(id), body.items).map(Json)
}

async fn get_conversation_item(
    State(state): State<AppStateRef>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (id, item_id) = ids.map_or_else(|_| Default::default(), |Path(ids)| ids);
    state.conversations.item(&id, &item_id).map(Json)
}

async fn delete_conversation_item(
    State(state): State<AppStateRef>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<ConversationObject>, ApiError> {
    let (id, item_id) = ids.map_or_else(|_| Default::default(), |Path(ids)| ids);
    state.conversations.delete_item(&id, &item_id).map(Json)
}

async fn tokenize(State(state): State<AppStateRef>, request: Request) -> Result<Json<TokenizeResponse>, ApiError> {
    let body = read_body(request, &state).await?;
    off_runtime(&state, move |state| tokenize_body(&body, state))
        .await
        .map(Json)
}

fn tokenize_body(body: &[u8], state: &AppState) -> Result<TokenizeResponse, ApiError> {
    let request: TokenizeRequest = parse_json(body)?;
    check_model(request.model.as_deref(), state)?;
    let ready = ready(state)?;
    let tokenizer = &ready.tokenizer;
    let encode_error = |e: lily_chat::TokenizerError| ApiError::bad_request(format!("cannot tokenize: {e}"));
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => tokenizer
            .encode(&prompt, request.add_special_tokens.unwrap_or(true))
            .map_err(encode_error)?,
        (None, Some(messages)) => {
            let messages = chat::validate_messages(messages)?;
            chat::render_tokens(
                ready,
                messages,
                &request.tools.unwrap_or_default(),
                chat::validate_kwargs(request.chat_template_kwargs.unwrap_or_default())?,
                request.add_generation_prompt.unwrap_or(true),
            )?
            .1
        }
        (Some(_), Some(_)) => return Err(ApiError::bad_request("give either `prompt` or `messages`, not both")),
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` (text) or `messages` (a conversation) is required",
            ))
        }
    };
    let token_strs = request.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: ready.context,
        tokens,
        token_strs,
    })
}

async fn detokenize(State(state): State<AppStateRef>, request: Request) -> Result<Json<DetokenizeResponse>, ApiError> {
    let body = read_body(request, &state).await?;
    off_runtime(&state, move |state| detokenize_body(&body, state))
        .await
        .map(Json)
}

fn detokenize_body(body: &[u8], state: &AppState) -> Result<DetokenizeResponse, ApiError> {
    let request: DetokenizeRequest = parse_json(body)?;
    check_model(request.model.as_deref(), state)?;
    let ready = ready(state)?;
    let ids = request
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
    let limit = ready.vocab_size;
    let ids = ids
        .into_iter()
        .map(|id| {
            u32::try_from(id).ok().filter(|&t| (t as usize) < limit).ok_or_else(|| {
                ApiError::invalid(
                    "tokens",
                    format!("token id {id} is outside the vocabulary (0..{limit})"),
                )
            })
        })
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let prompt = ready
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::bad_request(format!("cannot detokenize: {e}")))?;
    Ok(DetokenizeResponse { prompt })
}

//! The responses `/v1/responses` keeps (`store`, on by default as in OpenAI's API), so that a request can continue
//! one by its id (`previous_response_id`) instead of sending the whole conversation again, and so that clients can
//! read one back (`GET /v1/responses/{id}`, its input items) or delete it.
//!
//! A `background` response is kept from the moment it is accepted (`in_progress`), and replaced by its final form
//! when it ends (completed, incomplete, failed or cancelled); the store also holds the means to cancel it
//! (`POST /v1/responses/{id}/cancel`) and to wait until it has ended. A background response created with
//! `stream` also keeps its stream's events ([`EventLog`]): its client reads them as they come, and any client can
//! read them again from any point (`GET /v1/responses/{id}?stream=true&starting_after=N`), while it runs and after,
//! for as long as the response is kept.
//!
//! The store lives in memory and holds at most `--response-store-mib` of responses; past that the least recently
//! used are dropped. A response links to the one it continues, so a conversation's context stays whole while any of
//! its responses is kept, even where older ones were dropped: a client that continues a kept response never finds a
//! hole in the middle of its conversation. The store counts each response as the bytes of its whole conversation, so
//! what it holds never exceeds its limit, however the conversations share their older responses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value as Json;

use crate::lru::Lru;
use crate::routes::SseData;
use crate::types::ResponseObject;

/// The most events [`EventLog::read_from`] returns at a time.
const READ_EVENTS: usize = 256;

/// The events of a streamed background response, in order (an event's index is its `sequence_number`), and whether
/// the stream has ended. Readers follow it from any point while it grows.
pub struct EventLog {
    events: Mutex<(Vec<SseData>, bool)>,
    /// The number of events, and whether the stream has ended, for readers waiting for more.
    changed: tokio::sync::watch::Sender<(usize, bool)>,
}

impl EventLog {
    fn new() -> EventLog {
        EventLog {
            events: Mutex::new((Vec::new(), false)),
            changed: tokio::sync::watch::channel((0, false)).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, (Vec<SseData>, bool)> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends events (none once the stream has ended).
    pub fn push(&self, events: Vec<SseData>) {
        let mut log = self.lock();
        if log.1 || events.is_empty() {
            return;
        }
        log.0.extend(events);
        self.changed.send_replace((log.0.len(), false));
    }

    /// Ends the stream: readers stop once they have read every event.
    pub fn end(&self) {
        let mut log = self.lock();
        log.1 = true;
        self.changed.send_replace((log.0.len(), true));
    }

    /// The bytes its events hold.
    pub fn bytes(&self) -> usize {
        self.lock().0.iter().map(|e| e.data.len() + 64).sum()
    }

    /// The events from index `from` on (at most [`READ_EVENTS`] at a time, so that readers of a long log do not
    /// hold its lock long), waiting for more while the stream runs: empty once it has ended and every event is read.
    pub async fn read_from(&self, from: usize) -> Vec<SseData> {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let log = self.lock();
                if log.0.len() > from || log.1 {
                    let end = log.0.len().min(from.saturating_add(READ_EVENTS));
                    return log.0.get(from..end).map_or_else(Vec::new, <[SseData]>::to_vec);
                }
            }
            // The sender lives as long as the log, which the caller holds.
            if changed.changed().await.is_err() {
                return Vec::new();
            }
        }
    }
}

/// A kept response: the response object as it was answered, the input items its request gave, and the response it
/// continued.
pub struct StoredResponse {
    pub response: ResponseObject,
    /// The request's own input items, each with an `id`.
    pub input: Vec<Json>,
    /// The response this one continued (`previous_response_id`).
    pub previous: Option<Arc<StoredResponse>>,
    /// The bytes of this response's JSON and input items, and those of every response it continues.
    conversation_bytes: usize,
    /// A streamed background response's events (attached by the store when its final form replaces it).
    events: Option<Arc<EventLog>>,
}

impl StoredResponse {
    pub fn new(response: ResponseObject, input: Vec<Json>, previous: Option<Arc<StoredResponse>>) -> StoredResponse {
        let own = serde_json::to_vec(&response).map_or(0, |v| v.len())
            + input
                .iter()
                .map(|item| serde_json::to_vec(item).map_or(0, |v| v.len()))
                .sum::<usize>();
        let conversation_bytes = own + previous.as_ref().map_or(0, |p| p.conversation_bytes);
        StoredResponse {
            response,
            input,
            previous,
            conversation_bytes,
            events: None,
        }
    }

    /// Every input item that led to this response, oldest first: the input and output items of the responses it
    /// continues, then its own input items. This is what `GET /v1/responses/{id}/input_items` lists.
    pub fn input_items(&self) -> Vec<Json> {
        let mut chain = Vec::new();
        let mut next = self.previous.as_deref();
        while let Some(response) = next {
            chain.push(response);
            next = response.previous.as_deref();
        }
        let mut items = Vec::new();
        for response in chain.iter().rev() {
            items.extend(response.input.iter().cloned());
            items.extend(response.output_items());
        }
        items.extend(self.input.iter().cloned());
        items
    }

    /// The conversation that a response continuing this one starts from: its input items, then its output items
    /// (which the Responses API takes back as input items).
    pub fn conversation(&self) -> Vec<Json> {
        let mut items = self.input_items();
        items.extend(self.output_items());
        items
    }

    fn output_items(&self) -> impl Iterator<Item = Json> + '_ {
        (self.response.output.iter()).filter_map(|item| serde_json::to_value(item).ok())
    }
}

impl Drop for StoredResponse {
    /// Drops a long chain of responses one link at a time: the default drop would recurse once per response.
    fn drop(&mut self) {
        let mut next = self.previous.take();
        while let Some(response) = next {
            next = match Arc::try_unwrap(response) {
                Ok(mut response) => response.previous.take(),
                Err(_) => None,
            };
        }
    }
}

/// The kept responses by id, with the order in which they were last used, and the background responses still
/// running.
pub struct ResponseStore {
    inner: Mutex<Lru<Arc<StoredResponse>>>,
    running: Mutex<HashMap<String, Running>>,
    enabled: bool,
}

/// A background response still running: what asks it to stop, what tells that it has ended, and its stream's
/// events where it was created with `stream`.
struct Running {
    cancel: Arc<tokio::sync::Notify>,
    ended: tokio::sync::watch::Receiver<bool>,
    events: Option<Arc<EventLog>>,
}

/// Held by the task that runs a background response: its cancel request, and (once dropped) the signal that it has
/// ended, which also takes it out of the running ones.
pub struct Background {
    store: Arc<ResponseStore>,
    id: String,
    pub cancel: Arc<tokio::sync::Notify>,
    ended: tokio::sync::watch::Sender<bool>,
    /// Where a streamed response's events go.
    pub events: Option<Arc<EventLog>>,
}

impl Drop for Background {
    fn drop(&mut self) {
        self.store.lock_running().remove(&self.id);
        if let Some(events) = &self.events {
            events.end();
        }
        let _ = self.ended.send(true);
    }
}

impl ResponseStore {
    /// A store that holds up to `capacity_bytes` (0: keeps nothing).
    pub fn new(capacity_bytes: usize) -> ResponseStore {
        ResponseStore {
            inner: Mutex::new(Lru::new(capacity_bytes)),
            running: Mutex::new(HashMap::new()),
            enabled: capacity_bytes > 0,
        }
    }

    /// Whether the store keeps responses at all.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    fn lock(&self) -> MutexGuard<'_, Lru<Arc<StoredResponse>>> {
        // The store's state stays consistent between statements, so a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Taken after `inner` where both are held (`put`), never the other way round.
    fn lock_running(&self) -> MutexGuard<'_, HashMap<String, Running>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers the background response `id` as running, with a log of its stream's events where `streamed`; the
    /// task that runs it holds what this returns.
    pub fn start_background(self: &Arc<Self>, id: &str, streamed: bool) -> Background {
        let cancel = Arc::new(tokio::sync::Notify::new());
        let (ended, ended_rx) = tokio::sync::watch::channel(false);
        let events = streamed.then(|| Arc::new(EventLog::new()));
        let running = Running {
            cancel: cancel.clone(),
            ended: ended_rx,
            events: events.clone(),
        };
        self.lock_running().insert(id.to_string(), running);
        Background {
            store: self.clone(),
            id: id.to_string(),
            cancel,
            ended,
            events,
        }
    }

    /// The stream's events of the response `id`, running or kept; `None` where it was not a streamed background
    /// response (or is not kept).
    pub fn events(&self, id: &str) -> Option<Arc<EventLog>> {
        if let Some(events) = self.lock_running().get(id).and_then(|run| run.events.clone()) {
            return Some(events);
        }
        self.get(id).and_then(|response| response.events.clone())
    }

    /// Asks the background response `id` to stop and waits (up to `wait`) until it has ended. False where it was
    /// not running.
    pub async fn cancel_background(&self, id: &str, wait: std::time::Duration) -> bool {
        let ended = {
            let running = self.lock_running();
            let Some(run) = running.get(id) else {
                return false;
            };
            // A permit is stored if the task is not waiting yet, so the request is never lost.
            run.cancel.notify_one();
            run.ended.clone()
        };
        let mut ended = ended;
        let _ = tokio::time::timeout(wait, ended.wait_for(|ended| *ended)).await;
        true
    }

    /// Replaces the kept response with `response`'s id by `response` (a background response's final form), keeping
    /// nothing where it is no longer kept (deleted while it ran).
    pub fn replace(&self, response: StoredResponse) -> bool {
        self.put(response, true, true)
    }

    /// [`ResponseStore::replace`] without the stream's events: the small failure kept where a final form with
    /// them found no room.
    pub fn replace_without_events(&self, response: StoredResponse) -> bool {
        self.put(response, true, false)
    }

    /// Keeps `response`, dropping the least recently used ones (never a running background response) until it
    /// fits. Returns false where it is not kept: the store is off, or there is no room for it.
    pub fn insert(&self, response: StoredResponse) -> bool {
        self.put(response, false, true)
    }

    /// Keeps `response` where `only_replacing` is false or a response of its id is kept; what it replaces stays
    /// where it does not fit. The running background responses are never dropped for room: their end replaces
    /// them.
    ///
    /// Where `events`, a streamed background response takes its stream's events along, counted in its
    /// conversation's bytes (a response that continues it holds them too), with room for the events that end the
    /// stream, which come after it is kept and repeat its output about four times.
    fn put(&self, mut response: StoredResponse, only_replacing: bool, events: bool) -> bool {
        let id = response.response.id.clone();
        let mut inner = self.lock();
        if only_replacing && !inner.contains(&id) {
            return false;
        }
        let running = self.lock_running();
        if let Some(log) = running.get(&id).and_then(|run| run.events.clone()).filter(|_| events) {
            let last = serde_json::to_vec(&response.response).map_or(0, |v| v.len());
            response.conversation_bytes += log.bytes() + 4 * last;
            response.events = Some(log);
        }
        let bytes = response.conversation_bytes;
        inner.insert(id, Arc::new(response), bytes, |id| running.contains_key(id))
    }

    /// The response with this id, now the most recently used.
    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        self.lock().get(id).cloned()
    }

    /// Forgets the response with this id; false where there was none.
    pub fn remove(&self, id: &str) -> bool {
        self.lock().remove(id).is_some()
    }

    /// The responses kept and the bytes they count for.
    pub fn usage(&self) -> (usize, usize) {
        self.lock().usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ResponseItem, ResponsePart};
    use serde_json::json;

    fn response(id: &str, text: &str) -> ResponseObject {
        ResponseObject {
            id: id.to_string(),
            object: "response",
            created_at: 0,
            status: "completed",
            model: "m".into(),
            output: vec![ResponseItem::Message {
                id: format!("msg_{id}"),
                status: "completed",
                role: "assistant",
                content: vec![ResponsePart::OutputText {
                    text: text.into(),
                    annotations: Vec::new(),
                    logprobs: Vec::new(),
                }],
            }],
            usage: None,
            incomplete_details: None,
            error: None,
            instructions: None,
            max_output_tokens: None,
            parallel_tool_calls: true,
            temperature: None,
            top_p: None,
            tool_choice: json!("auto"),
            tools: Vec::new(),
            text: json!({}),
            reasoning: json!({}),
            metadata: json!({}),
            store: true,
            previous_response_id: None,
            truncation: "disabled",
            background: false,
            conversation: None,
        }
    }

    fn user(text: &str) -> Json {
        json!({"type": "message", "role": "user", "content": text, "id": format!("in_{text}")})
    }

    fn texts(items: &[Json]) -> Vec<String> {
        let text = |item: &Json| match &item["content"] {
            Json::String(s) => s.clone(),
            parts => parts[0]["text"].as_str().unwrap_or_default().to_string(),
        };
        items.iter().map(text).collect()
    }

    #[test]
    fn a_chain_gives_back_its_whole_conversation_in_order() {
        let first = Arc::new(StoredResponse::new(response("a", "one"), vec![user("hi")], None));
        let second = Arc::new(StoredResponse::new(
            response("b", "two"),
            vec![user("more")],
            Some(first),
        ));
        let third = StoredResponse::new(response("c", "three"), vec![user("again")], Some(second));
        assert_eq!(texts(&third.input_items()), ["hi", "one", "more", "two", "again"]);
        assert_eq!(
            texts(&third.conversation()),
            ["hi", "one", "more", "two", "again", "three"]
        );
        assert_eq!(third.conversation()[1]["type"], "message");
        assert_eq!(third.conversation()[1]["role"], "assistant");
    }

    #[test]
    fn the_least_recently_used_go_first_and_chains_survive_eviction() {
        let a = StoredResponse::new(response("a", "one"), vec![user("hi")], None);
        let size = crate::lru::entry_bytes("a", a.conversation_bytes);
        // Room for three responses of the first one's size.
        let store = ResponseStore::new(3 * size + size / 2);
        assert!(store.insert(a));
        assert!(store.insert(StoredResponse::new(response("x", "one"), vec![user("hi")], None)));
        assert!(store.insert(StoredResponse::new(response("y", "one"), vec![user("hi")], None)));
        // `a` is used, so `x` is the least recently used when `z` comes.
        let a = store.get("a").expect("kept");
        assert!(store.insert(StoredResponse::new(response("z", "one"), vec![user("hi")], None)));
        assert!(store.get("x").is_none());
        assert!(store.get("y").is_some() && store.get("z").is_some());
        // A continuation counts its whole conversation (about twice one response), so two more go.
        let b = StoredResponse::new(response("b", "two"), vec![user("more")], Some(a));
        assert!(b.conversation_bytes > size);
        assert!(store.insert(b));
        assert!(store.get("a").is_none());
        let b = store.get("b").expect("the newest is kept");
        assert_eq!(texts(&b.conversation()), ["hi", "one", "more", "two"]);
        let (count, bytes) = store.usage();
        assert!(bytes <= 3 * size + size / 2, "{bytes} bytes in {count} responses");
    }

    #[test]
    fn a_running_background_response_is_never_dropped_for_room() {
        let a = StoredResponse::new(response("a", "one"), vec![user("hi")], None);
        let size = crate::lru::entry_bytes("a", a.conversation_bytes);
        let store = Arc::new(ResponseStore::new(2 * size + size / 2));
        let running = store.start_background("a", false);
        assert!(store.insert(a));
        assert!(store.insert(StoredResponse::new(response("x", "one"), vec![user("hi")], None)));
        // `a` is the least recently used, but running: `x` goes instead.
        assert!(store.insert(StoredResponse::new(response("y", "one"), vec![user("hi")], None)));
        assert!(store.get("a").is_some() && store.get("x").is_none());
        // Its end replaces it; once ended it may go like any other.
        assert!(store.replace(StoredResponse::new(response("a", "two"), vec![user("hi")], None)));
        drop(running);
        assert!(store.insert(StoredResponse::new(response("z", "one"), vec![user("hi")], None)));
        assert!(store.get("y").is_none() || store.get("a").is_none());
        // Replacing what is not kept keeps nothing.
        assert!(!store.replace(StoredResponse::new(response("gone", "one"), vec![user("hi")], None)));
        assert!(store.get("gone").is_none());
    }

    #[tokio::test]
    async fn a_streamed_background_response_keeps_its_events_for_readers_from_any_point() {
        let event = |n: usize| SseData {
            event: Some("response.output_text.delta"),
            data: format!("{{\"sequence_number\":{n}}}"),
        };
        let store = Arc::new(ResponseStore::new(1 << 20));
        let running = store.start_background("a", true);
        assert!(store.insert(StoredResponse::new(response("a", ""), vec![user("hi")], None)));
        let log = store.events("a").expect("a streamed response has a log");
        log.push(vec![event(0), event(1)]);
        // A reader past the end waits for the next event.
        let reader = {
            let log = log.clone();
            tokio::spawn(async move { log.read_from(2).await })
        };
        tokio::task::yield_now().await;
        assert!(!reader.is_finished());
        log.push(vec![event(2)]);
        let read = reader.await.unwrap();
        assert_eq!(
            read.iter().map(|e| e.data.as_str()).collect::<Vec<_>>(),
            [event(2).data]
        );
        // The final form takes the log along, counted in its bytes; the log ends with the running response.
        let (_, before) = store.usage();
        assert!(store.replace(StoredResponse::new(response("a", "done"), vec![user("hi")], None)));
        let (_, after) = store.usage();
        assert!(after >= before + log.bytes(), "{before} -> {after} bytes");
        log.push(vec![event(3)]);
        drop(running);
        log.push(vec![event(4)]);
        let kept = store.events("a").expect("kept with the response");
        assert_eq!(kept.read_from(1).await.len(), 3);
        assert!(
            kept.read_from(4).await.is_empty(),
            "a reader at the end of an ended log stops"
        );
        // A response that did not stream has none.
        let _plain = store.start_background("b", false);
        assert!(store.insert(StoredResponse::new(response("b", ""), vec![user("hi")], None)));
        assert!(store.events("b").is_none() && store.events("missing").is_none());
    }

    #[test]
    fn removed_and_oversized_responses_are_not_kept() {
        let store = ResponseStore::new(1 << 20);
        assert!(store.insert(StoredResponse::new(response("a", "one"), vec![user("hi")], None)));
        assert!(store.remove("a"));
        assert!(!store.remove("a"));
        assert!(store.get("a").is_none());
        assert_eq!(store.usage(), (0, 0));
        let big = "x".repeat(2 << 20);
        assert!(!store.insert(StoredResponse::new(response("b", &big), vec![user("hi")], None)));
        assert!(store.get("b").is_none());
        let off = ResponseStore::new(0);
        assert!(!off.enabled());
        assert!(!off.insert(StoredResponse::new(response("c", "one"), vec![user("hi")], None)));
    }

    #[test]
    fn a_long_chain_drops_without_deep_recursion() {
        let mut last: Option<Arc<StoredResponse>> = None;
        for i in 0..200_000 {
            let id = format!("r{i}");
            last = Some(Arc::new(StoredResponse::new(response(&id, "t"), Vec::new(), last)));
        }
        drop(last);
    }
}

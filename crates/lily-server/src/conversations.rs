//! OpenAI's Conversations API: a conversation is a list of items (messages, reasoning, function calls and their
//! outputs, as the Responses API takes them) that the server keeps. A response created with `conversation` reads
//! the conversation's items before its own input, and once it has completed, its input and output items are added
//! to the conversation. Conversations live in memory, up to `--response-store-mib` of them (apart from the kept
//! responses), the least recently used dropped first, until the server restarts.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value as Json};

use crate::error::ApiError;
use crate::lru::Lru;
use crate::params;
use crate::responses;
use crate::types::{ConversationObject, ItemList};

/// The most items one request may add (OpenAI's limit), and the most metadata pairs and their lengths.
const MAX_ADDED_ITEMS: usize = 20;
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

#[derive(Clone)]
struct Conversation {
    object: ConversationObject,
    /// Oldest first, each with an `id` of its own.
    items: Vec<Json>,
    /// What the store counts it for: its items' and metadata's JSON.
    bytes: usize,
}

impl Conversation {
    /// Counts the conversation's JSON, and for each item what holding it costs beyond its text.
    fn measure(&mut self) {
        let json_bytes = |v: &Json| serde_json::to_vec(v).map_or(0, |v| v.len()) + crate::lru::ENTRY_OVERHEAD;
        self.bytes = json_bytes(&self.object.metadata) + self.items.iter().map(json_bytes).sum::<usize>();
    }
}

/// The kept conversations, and those a response is using (which take no other response, and are never dropped
/// for room, until it ends).
pub struct ConversationStore {
    inner: Mutex<Lru<Conversation>>,
    busy: Mutex<HashSet<String>>,
}

/// A conversation's hold by the response that uses it; dropped, the conversation takes responses again.
pub struct Busy {
    store: Arc<ConversationStore>,
    id: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.store.lock_busy().remove(&self.id);
    }
}

impl ConversationStore {
    /// A store that holds up to `capacity_bytes` of conversations (0: none can be created).
    pub fn new(capacity_bytes: usize) -> ConversationStore {
        ConversationStore {
            inner: Mutex::new(Lru::new(capacity_bytes)),
            busy: Mutex::new(HashSet::new()),
        }
    }

    /// Taken after `inner` where both are held, never the other way round.
    fn lock_busy(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds conversation `id` for a response until what this returns is dropped; refused (400
    /// `conversation_locked`, as OpenAI's API does) while another response holds it, so that each response reads
    /// the items of the ones before it.
    pub fn begin(self: &Arc<Self>, id: &str) -> Result<Busy, ApiError> {
        if !self.lock().contains(id) {
            return Err(not_found(id).with_param("conversation"));
        }
        if !self.lock_busy().insert(id.to_string()) {
            return Err(ApiError::invalid(
                "conversation",
                format!(
                    "Another response is in progress for conversation {:?}; send this one once it has ended",
                    params::shown_id(id)
                ),
            )
            .with_code("conversation_locked"));
        }
        Ok(Busy {
            store: self.clone(),
            id: id.to_string(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru<Conversation>> {
        // The store's state stays consistent between statements, so a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new conversation with `metadata` and up to 20 `items`.
    pub fn create(&self, metadata: Option<Json>, items: Option<Vec<Json>>) -> Result<ConversationObject, ApiError> {
        let items = checked_items(items.unwrap_or_default(), &[])?;
        let mut conversation = Conversation {
            object: ConversationObject {
                id: params::random_id("conv_"),
                object: "conversation",
                created_at: params::unix_now(),
                metadata: checked_metadata(metadata)?,
            },
            items,
            bytes: 0,
        };
        conversation.measure();
        let object = conversation.object.clone();
        let bytes = conversation.bytes;
        let mut inner = self.lock();
        let busy = self.lock_busy();
        if !inner.insert(object.id.clone(), conversation, bytes, |id| busy.contains(id)) {
            return Err(ApiError::bad_request(
                "no room for this conversation in the server's store (--response-store-mib)",
            ));
        }
        Ok(object)
    }

    pub fn get(&self, id: &str) -> Result<ConversationObject, ApiError> {
        let mut inner = self.lock();
        inner.get(id).map(|c| c.object.clone()).ok_or_else(|| not_found(id))
    }

    /// The conversation's items, oldest first.
    pub fn items(&self, id: &str) -> Result<Vec<Json>, ApiError> {
        let mut inner = self.lock();
        inner.get(id).map(|c| c.items.clone()).ok_or_else(|| not_found(id))
    }

    pub fn item(&self, id: &str, item_id: &str) -> Result<Json, ApiError> {
        let items = self.items(id)?;
        items
            .into_iter()
            .find(|item| item["id"] == item_id)
            .ok_or_else(|| item_not_found(id, item_id))
    }

    /// Replaces the conversation's metadata.
    pub fn update(&self, id: &str, metadata: Option<Json>) -> Result<ConversationObject, ApiError> {
        let metadata = checked_metadata(metadata)?;
        self.modify(id, |c| {
            c.object.metadata = metadata;
            Ok(c.object.clone())
        })
    }

    pub fn delete(&self, id: &str) -> Result<Json, ApiError> {
        self.lock().remove(id).ok_or_else(|| not_found(id))?;
        Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
    }

    /// Adds up to 20 items a client gives (checked as a response's input is); answers them as added.
    pub fn add_items(&self, id: &str, items: Option<Vec<Json>>) -> Result<ItemList, ApiError> {
        let items = items.ok_or_else(|| ApiError::invalid("items", "`items` is required"))?;
        self.modify(id, |c| {
            let added = checked_items(items, &c.items)?;
            c.items.extend(added.iter().cloned());
            Ok(list(added))
        })
    }

    /// Adds a finished response's input and output items; false where the conversation is gone or full.
    pub fn append(&self, id: &str, items: Vec<Json>) -> bool {
        self.modify(id, |c| {
            let items = responses::normalized(items, c.items.iter().filter_map(item_id).collect());
            c.items.extend(items);
            Ok(())
        })
        .is_ok()
    }

    /// Deletes one item; answers the conversation.
    pub fn delete_item(&self, id: &str, item_id: &str) -> Result<ConversationObject, ApiError> {
        self.modify(id, |c| {
            let at =
                (c.items.iter().position(|item| item["id"] == item_id)).ok_or_else(|| item_not_found(id, item_id))?;
            c.items.remove(at);
            Ok(c.object.clone())
        })
    }

    /// Applies `change` to the conversation `id` and counts its new size; where `change` fails, or the changed
    /// conversation finds no room, it stays as it was.
    fn modify<R>(
        &self,
        id: &str,
        change: impl FnOnce(&mut Conversation) -> Result<R, ApiError>,
    ) -> Result<R, ApiError> {
        let mut inner = self.lock();
        let Some(original) = inner.remove(id) else {
            return Err(not_found(id));
        };
        let mut changed = original.clone();
        let result = change(&mut changed);
        changed.measure();
        let busy = self.lock_busy();
        let pinned = |other: &str| busy.contains(other);
        let bytes = changed.bytes;
        if result.is_ok() && inner.insert(id.to_string(), changed, bytes, pinned) {
            return result;
        }
        // The original was just taken out, so its room is free.
        let bytes = original.bytes;
        inner.insert(id.to_string(), original, bytes, pinned);
        result.and(Err(ApiError::bad_request(
            "no room for the changed conversation in the server's store (--response-store-mib)",
        )))
    }

    /// The conversations kept and the bytes they count for.
    pub fn usage(&self) -> (usize, usize) {
        self.lock().usage()
    }
}

fn item_id(item: &Json) -> Option<String> {
    item["id"].as_str().map(String::from)
}

fn list(data: Vec<Json>) -> ItemList {
    ItemList {
        object: "list",
        first_id: data.first().and_then(item_id),
        last_id: data.last().and_then(item_id),
        has_more: false,
        data,
    }
}

/// Items a client adds: at most 20, each one a response could take as input, kept in the API's form with an id
/// that no item of `existing` has.
fn checked_items(items: Vec<Json>, existing: &[Json]) -> Result<Vec<Json>, ApiError> {
    if items.len() > MAX_ADDED_ITEMS {
        return Err(ApiError::invalid(
            "items",
            format!(
                "at most {MAX_ADDED_ITEMS} items can be added at a time, got {}",
                items.len()
            ),
        ));
    }
    if !items.is_empty() {
        responses::check_input_items(&items).map_err(|mut error| {
            error.param = error.param.map(|p| p.replacen("input", "items", 1));
            error.message = error.message.replacen("input", "items", 1);
            error
        })?;
    }
    Ok(responses::normalized(
        items,
        existing.iter().filter_map(item_id).collect(),
    ))
}

/// Metadata as OpenAI takes it: up to 16 string values, keys up to 64 characters and values up to 512.
fn checked_metadata(metadata: Option<Json>) -> Result<Json, ApiError> {
    let metadata = match metadata {
        None | Some(Json::Null) => return Ok(json!({})),
        Some(Json::Object(map)) => map,
        Some(_) => return Err(ApiError::invalid("metadata", "`metadata` must be an object")),
    };
    if metadata.len() > MAX_METADATA_PAIRS {
        return Err(ApiError::invalid(
            "metadata",
            format!("`metadata` holds at most {MAX_METADATA_PAIRS} pairs"),
        ));
    }
    for (key, value) in &metadata {
        let fits = value.as_str().is_some_and(|v| v.chars().count() <= MAX_METADATA_VALUE);
        if key.chars().count() > MAX_METADATA_KEY || !fits {
            return Err(ApiError::invalid(
                "metadata",
                format!(
                    "`metadata` keys are up to {MAX_METADATA_KEY} characters and values strings of up to \
                     {MAX_METADATA_VALUE}"
                ),
            ));
        }
    }
    Ok(Json::Object(metadata))
}

pub fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "No conversation with id {:?} (never created, deleted, or dropped for room; conversations are kept in \
         memory until the server restarts)",
        params::shown_id(id)
    ))
}

fn item_not_found(id: &str, item_id: &str) -> ApiError {
    ApiError::not_found(format!(
        "Conversation {:?} has no item with id {:?}",
        params::shown_id(id),
        params::shown_id(item_id)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Json {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn items_are_added_listed_and_deleted() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let c = store
            .create(Some(json!({"topic": "verona"})), Some(vec![user("hi")]))
            .unwrap();
        assert!(c.id.starts_with("conv_") && c.object == "conversation");
        assert_eq!(store.get(&c.id).unwrap().metadata, json!({"topic": "verona"}));
        let added = store.add_items(&c.id, Some(vec![user("more"), user("again")])).unwrap();
        assert_eq!(added.data.len(), 2);
        let items = store.items(&c.id).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0]["content"], json!([{"type": "input_text", "text": "hi"}]));
        assert_eq!(items[1]["id"], added.data[0]["id"]);
        let second = items[1]["id"].as_str().unwrap().to_string();
        assert_eq!(store.item(&c.id, &second).unwrap()["content"][0]["text"], "more");
        store.delete_item(&c.id, &second).unwrap();
        assert_eq!(store.items(&c.id).unwrap().len(), 2);
        assert_eq!(store.item(&c.id, &second).unwrap_err().status.as_u16(), 404);
        assert!(store.append(
            &c.id,
            vec![json!({"type": "message", "role": "assistant", "content": "ok"})]
        ));
        assert_eq!(store.items(&c.id).unwrap().len(), 3);
        let updated = store.update(&c.id, Some(json!({"topic": "mantua"}))).unwrap();
        assert_eq!(updated.metadata["topic"], "mantua");
        assert_eq!(store.delete(&c.id).unwrap()["deleted"], true);
        assert_eq!(store.get(&c.id).unwrap_err().status.as_u16(), 404);
        assert!(!store.append(&c.id, vec![user("late")]));
    }

    #[test]
    fn a_conversation_takes_one_response_at_a_time_and_is_not_dropped_meanwhile() {
        // Room for about three small conversations.
        let store = Arc::new(ConversationStore::new(3000));
        let c = store.create(None, Some(vec![user("hi")])).unwrap();
        let busy = store.begin(&c.id).unwrap();
        let error = store.begin(&c.id).err().unwrap();
        assert_eq!((error.status.as_u16(), error.code), (400, Some("conversation_locked")));
        // Other conversations push each other out, never the busy one.
        for _ in 0..5 {
            store.create(None, Some(vec![user("more")])).unwrap();
        }
        assert!(store.get(&c.id).is_ok());
        drop(busy);
        assert!(store.begin(&c.id).is_ok());
        assert_eq!(store.begin("conv_none").err().unwrap().status.as_u16(), 404);
    }

    #[test]
    fn bad_items_metadata_and_oversized_conversations_are_refused() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let too_many = (0..21).map(|i| user(&i.to_string())).collect();
        for (metadata, items, param) in [
            (None, Some(too_many), "items"),
            (None, Some(vec![json!({"type": "input_image"})]), "items[0].type"),
            (Some(json!("x")), None, "metadata"),
            (Some(json!({"k": 1})), None, "metadata"),
            (Some(json!({"k": "v".repeat(513)})), None, "metadata"),
        ] {
            let error = store.create(metadata, items).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{}", error.message);
        }
        // A conversation never grows past the store: the change is refused and it stays as it was.
        let small = ConversationStore::new(1500);
        let c = small.create(None, Some(vec![user("hi")])).unwrap();
        let error = small.add_items(&c.id, Some(vec![user(&"x".repeat(1000))])).unwrap_err();
        assert_eq!(error.status.as_u16(), 400);
        assert_eq!(small.items(&c.id).unwrap().len(), 1);
    }
}

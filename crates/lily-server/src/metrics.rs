//! Prometheus metrics (`GET /metrics`), recorded with the `metrics` crate into a Prometheus recorder that each
//! server owns (not the process-global one, so several servers in one process, as in tests, keep apart).

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

pub const REQUESTS: &str = "lily_requests_total";
pub const PROMPT_TOKENS: &str = "lily_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "lily_generation_tokens_total";
pub const TTFT: &str = "lily_time_to_first_token_seconds";
pub const TPOT: &str = "lily_time_per_output_token_seconds";
pub const E2E: &str = "lily_request_duration_seconds";
pub const QUEUE_DEPTH: &str = "lily_queue_depth";
pub const RUNNING: &str = "lily_requests_running";
pub const REJECTED: &str = "lily_requests_rejected_total";
pub const CANCELLED: &str = "lily_requests_cancelled_total";
pub const PREEMPTIONS: &str = "lily_preemptions_total";
pub const PREFIX_QUERIES: &str = "lily_prefix_cache_queries_total";
pub const PREFIX_QUERY_TOKENS: &str = "lily_prefix_cache_query_tokens_total";
pub const PREFIX_HITS: &str = "lily_prefix_cache_hits_total";
pub const PREFIX_HIT_TOKENS: &str = "lily_prefix_cache_hit_tokens_total";
pub const PREFIX_EVICTIONS: &str = "lily_prefix_cache_evictions_total";
pub const PREFIX_SNAPSHOTS: &str = "lily_prefix_cache_snapshots";
pub const PREFIX_BYTES: &str = "lily_prefix_cache_bytes";
pub const SEGMENT_CACHE_BYTES: &str = "lily_tokenizer_segment_cache_bytes";
pub const WORD_CACHE_BYTES: &str = "lily_tokenizer_word_cache_bytes";
pub const RESPONSES_STORED: &str = "lily_responses_stored";
pub const RESPONSE_STORE_BYTES: &str = "lily_response_store_bytes";
pub const CONVERSATIONS: &str = "lily_conversations";
pub const CONVERSATION_STORE_BYTES: &str = "lily_conversation_store_bytes";

const METADATA: Metadata<'static> = Metadata::new("lily_server", Level::INFO, Some("lily_server::metrics"));

pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub queue_depth: Gauge,
    pub running: Gauge,
    pub rejected: Counter,
    pub cancelled: Counter,
    pub preemptions: Counter,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_query_tokens: Counter,
    pub prefix_cache_hits: Counter,
    pub prefix_cache_hit_tokens: Counter,
    pub prefix_cache_evictions: Counter,
    pub prefix_cache_snapshots: Gauge,
    pub prefix_cache_bytes: Gauge,
    pub segment_cache_bytes: Gauge,
    pub word_cache_bytes: Gauge,
    pub responses_stored: Gauge,
    pub response_store_bytes: Gauge,
    pub conversations: Gauge,
    pub conversation_store_bytes: Gauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let latency = [
            0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
        ];
        let ttft = [
            0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        ];
        let e2e = [
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
        ];
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(TTFT.into()), &ttft)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(TPOT.into()), &latency))
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(E2E.into()), &e2e))
            .expect("non-empty buckets")
            .build_recorder();
        let handle = recorder.handle();
        let describe =
            |name: &'static str, unit: Option<Unit>, help: &'static str| (name, unit, SharedString::const_str(help));
        let counters = [
            describe(REQUESTS, None, "HTTP requests answered, by endpoint and status code."),
            describe(
                PROMPT_TOKENS,
                None,
                "Prompt tokens processed (prefill), per generated sequence.",
            ),
            describe(GENERATION_TOKENS, None, "Tokens generated."),
            describe(REJECTED, None, "Requests refused with 429 because the queue was full."),
            describe(
                CANCELLED,
                None,
                "Generations cancelled (client disconnect or shutdown).",
            ),
            describe(
                PREEMPTIONS,
                None,
                "Sequences that gave their context back to let older ones grow, to be computed again later.",
            ),
            describe(
                PREFIX_QUERIES,
                None,
                "Prompts looked up in the prefix cache (one per sequence that prefilled its prompt).",
            ),
            describe(PREFIX_QUERY_TOKENS, None, "Prompt tokens of the prompts looked up."),
            describe(PREFIX_HITS, None, "Prompts that started from a cached prefix."),
            describe(
                PREFIX_HIT_TOKENS,
                None,
                "Prompt tokens taken from the prefix cache instead of being prefilled.",
            ),
            describe(
                PREFIX_EVICTIONS,
                None,
                "Snapshots dropped from the prefix cache to make room.",
            ),
        ];
        for (name, unit, help) in counters {
            recorder.describe_counter(KeyName::from_const_str(name), unit, help);
        }
        recorder.describe_histogram(
            KeyName::from_const_str(TTFT),
            Some(Unit::Seconds),
            SharedString::const_str("Time from a request's arrival to its first generated token."),
        );
        recorder.describe_histogram(
            KeyName::from_const_str(TPOT),
            Some(Unit::Seconds),
            SharedString::const_str("Time between consecutive generated tokens of a sequence."),
        );
        recorder.describe_histogram(
            KeyName::from_const_str(E2E),
            Some(Unit::Seconds),
            SharedString::const_str("Time from a request's arrival to its last generated token."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(QUEUE_DEPTH),
            None,
            SharedString::const_str("Requests waiting in the queue."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(RUNNING),
            None,
            SharedString::const_str("Requests being generated."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(PREFIX_SNAPSHOTS),
            None,
            SharedString::const_str("Snapshots in the prefix cache."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(PREFIX_BYTES),
            Some(Unit::Bytes),
            SharedString::const_str("Memory the prefix cache's snapshots hold that no running sequence shares."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(SEGMENT_CACHE_BYTES),
            Some(Unit::Bytes),
            SharedString::const_str("Memory the tokenizer's cache of prompt segments (text and ids) holds."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(WORD_CACHE_BYTES),
            Some(Unit::Bytes),
            SharedString::const_str("Memory the tokenizer's cache of words (text and ids) holds."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(RESPONSES_STORED),
            None,
            SharedString::const_str("Responses kept for previous_response_id and retrieval."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(RESPONSE_STORE_BYTES),
            Some(Unit::Bytes),
            SharedString::const_str("Bytes the kept responses count for (each its whole conversation's)."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(CONVERSATIONS),
            None,
            SharedString::const_str("Conversations kept (the Conversations API)."),
        );
        recorder.describe_gauge(
            KeyName::from_const_str(CONVERSATION_STORE_BYTES),
            Some(Unit::Bytes),
            SharedString::const_str("Bytes the kept conversations count for."),
        );
        let key = |name: &'static str| Key::from_static_name(name);
        Metrics {
            prompt_tokens: recorder.register_counter(&key(PROMPT_TOKENS), &METADATA),
            generation_tokens: recorder.register_counter(&key(GENERATION_TOKENS), &METADATA),
            ttft: recorder.register_histogram(&key(TTFT), &METADATA),
            tpot: recorder.register_histogram(&key(TPOT), &METADATA),
            e2e: recorder.register_histogram(&key(E2E), &METADATA),
            queue_depth: recorder.register_gauge(&key(QUEUE_DEPTH), &METADATA),
            running: recorder.register_gauge(&key(RUNNING), &METADATA),
            rejected: recorder.register_counter(&key(REJECTED), &METADATA),
            cancelled: recorder.register_counter(&key(CANCELLED), &METADATA),
            preemptions: recorder.register_counter(&key(PREEMPTIONS), &METADATA),
            prefix_cache_queries: recorder.register_counter(&key(PREFIX_QUERIES), &METADATA),
            prefix_cache_query_tokens: recorder.register_counter(&key(PREFIX_QUERY_TOKENS), &METADATA),
            prefix_cache_hits: recorder.register_counter(&key(PREFIX_HITS), &METADATA),
            prefix_cache_hit_tokens: recorder.register_counter(&key(PREFIX_HIT_TOKENS), &METADATA),
            prefix_cache_evictions: recorder.register_counter(&key(PREFIX_EVICTIONS), &METADATA),
            prefix_cache_snapshots: recorder.register_gauge(&key(PREFIX_SNAPSHOTS), &METADATA),
            prefix_cache_bytes: recorder.register_gauge(&key(PREFIX_BYTES), &METADATA),
            segment_cache_bytes: recorder.register_gauge(&key(SEGMENT_CACHE_BYTES), &METADATA),
            word_cache_bytes: recorder.register_gauge(&key(WORD_CACHE_BYTES), &METADATA),
            responses_stored: recorder.register_gauge(&key(RESPONSES_STORED), &METADATA),
            response_store_bytes: recorder.register_gauge(&key(RESPONSE_STORE_BYTES), &METADATA),
            conversations: recorder.register_gauge(&key(CONVERSATIONS), &METADATA),
            conversation_store_bytes: recorder.register_gauge(&key(CONVERSATION_STORE_BYTES), &METADATA),
            recorder,
            handle,
        }
    }

    /// Counts one answered HTTP request.
    pub fn request(&self, endpoint: &str, status: u16) {
        let labels = vec![
            Label::new("endpoint", endpoint.to_string()),
            Label::new("status", status.to_string()),
        ];
        self.recorder
            .register_counter(&Key::from_parts(REQUESTS, labels), &METADATA)
            .increment(1);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.handle.run_upkeep();
        self.handle.render()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
